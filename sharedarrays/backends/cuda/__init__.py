"""The CUDA memory systems (``vmm``, ``ipc``, ``pool``) and what they share: ``driver``
(loading, errors, fork safety), ``device`` (the base class, streams and semaphores), ``sync``
(cross-process ordering). No module imports a CUDA package until it is used."""
