"""The CUDA memory systems (``vmm`` in ``device``, ``ipc``, ``pool``) on ``driver`` and
``sync``; no module imports a CUDA package until it is used."""
