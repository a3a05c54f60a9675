"""AMD GPUs through HIP: ``hip-vmm`` (:mod:`~sharedarrays.backends.hip.vmm`) and ``hip-pool``
(:mod:`~sharedarrays.backends.hip.pool`), HIP's tables of calls for the backends written once
for every vendor (:mod:`sharedarrays.backends.vmm`, :mod:`sharedarrays.backends.pool`), with
the runtime loading and errors in :mod:`~sharedarrays.backends.hip.runtime` and the device,
its arrays and ordering in :mod:`~sharedarrays.backends.hip.device`.

Nothing here imports ``hip-python`` at import time: the runtime module is imported on first
use (see :func:`~sharedarrays.backends.hip.runtime.load_hip`).
"""
