"""The CUDA memory systems and what they share, in one folder.

``driver`` (loading cuda.bindings, errors, fork safety, why a device is unusable),
``device`` (:class:`~sharedarrays.backends.cuda.device.CudaDevice`: context, streams, CuPy
arrays, the public stream operations), ``vmm``, ``ipc`` and ``pool`` (the three memory
systems, each registered with :func:`sharedarrays.backends.registry.register`), ``sync``
(cross-process ordering: a ring of IPC events, one fence per pickled message) and
``semaphore`` (external semaphores). No module imports a CUDA package until it is used.
"""
