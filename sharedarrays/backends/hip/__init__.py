"""AMD GPUs through HIP: ``hip-vmm`` and ``hip-pool``, HIP's tables of calls for the
backends shared with CUDA (:mod:`..vmm`, :mod:`..pool`). hip-python is imported on first
use only (:func:`.runtime.load_hip`)."""
