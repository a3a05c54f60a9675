"""Huawei Ascend NPUs: the CANN runtime (loaded on first use) and the ``ascend`` backend."""
