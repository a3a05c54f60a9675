"""AMD GPUs through HIP: ``hip-vmm`` (:mod:`~sharedarrays.backends.hip.vmm`), with the runtime
loading, errors and arrays they share in :mod:`~sharedarrays.backends.hip.runtime`.

Nothing here imports ``hip-python`` at import time: the runtime module is imported on first
use (see :func:`~sharedarrays.backends.hip.runtime.load_hip`).
"""
