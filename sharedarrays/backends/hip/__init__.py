"""AMD GPUs through HIP (``hip-vmm``, ``hip-pool``): HIP's table of calls for the backends
shared with CUDA; hip-python is imported on first use only."""
