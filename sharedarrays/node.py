"""Node identity: two processes can open each other's payloads when they share the kernel's
boot, the real user id, and the mount and pid namespaces (a payload names socket paths and a
pid). The node id is a digest of these, or the id claimed with ``SHAREDARRAYS_NODE``."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re

from sharedarrays.errors import HandleUnavailable, fd_limit_error
from sharedarrays.settings import env_word

__all__ = ["NODE_VARIABLE", "NODE_PATTERN", "this_node", "machine_node"]

NODE_VARIABLE = "SHAREDARRAYS_NODE"
NODE_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")
"""What a node id looks like: the digest's 32 hex digits, or a claimed id."""

# a fact not there to read (no /proc, a hidden namespace file) is empty for good; any other
# error (too many open files) raises, and the next call reads again
_ABSENT = frozenset((errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM))


def _fact(path: str) -> str:
    """A namespace's identity (``/proc/self/ns/``), or a file's text."""
    try:
        if path.startswith("/proc/self/ns/"):
            st = os.stat(path)
            return f"{st.st_dev}:{st.st_ino}"
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        if e.errno in _ABSENT:
            return ""
        what = f"cannot read {path} to tell which node this process is on"
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(what, str(e.strerror)) from None
        raise HandleUnavailable(f"{what}: {e.strerror or e}; try again") from None


@functools.cache
def machine_node() -> str:
    """This process's node id from the facts, ignoring ``SHAREDARRAYS_NODE`` (read once):
    HandleUnavailable where a fact cannot be read now (the fd limit), read again next call."""
    paths = ("sys/kernel/random/boot_id", "self/ns/mnt", "self/ns/pid")
    boot, mnt, pid = (_fact(f"/proc/{p}") for p in paths)
    facts = "\0".join((boot, str(os.getuid()), mnt, pid))
    return hashlib.blake2b(facts.encode(), digest_size=16).hexdigest()


def this_node() -> str:
    """This process's node id: the one ``SHAREDARRAYS_NODE`` claims, else
    :func:`machine_node` (ValueError for a setting that is no node id)."""
    claimed = env_word(NODE_VARIABLE, NODE_PATTERN, "a node id (1 to 64 letters, digits or ._:-)")
    return machine_node() if claimed is None else claimed
