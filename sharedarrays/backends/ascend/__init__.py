"""Huawei Ascend NPUs: the CANN runtime (``libascendcl``) and the ``ascend`` backend.

Nothing here loads ``libascendcl`` at import time (see :mod:`.runtime`).
"""
