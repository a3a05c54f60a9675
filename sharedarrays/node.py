"""Node identity: which processes can open each other's payloads.

A payload names things that exist only on the machine, and for the user and the namespaces,
where it was made: the exporter's pid (a pid namespace), its handle server's socket path and
the keeper's runtime directory (a mount namespace), handles that only the same user may fetch
(the handle servers check the peer's uid), and memory that exists only until the kernel
reboots. Two processes are on the same **node** when all of these match:

- the kernel's boot (``/proc/sys/kernel/random/boot_id``: a fresh random id at each boot,
  different on every machine),
- the real user id,
- the mount namespace (``/proc/self/ns/mnt``: sockets are found by path),
- the pid namespace (``/proc/self/ns/pid``: the payload names a pid).

The node id is a digest of these four (32 hex digits); the network namespace does not matter
(the sockets have paths). A process may claim another node id with the setting
``SHAREDARRAYS_NODE`` (letters, digits and ``._:-``, at most 64): two processes claiming
different ids treat each other as on different nodes even on one machine, and two claiming
the same id as on one node (so only claim the same id where the four facts above match).
Engines (Dask) move an array as data instead of as a payload between nodes, and a payload
loaded on another node raises :class:`~sharedarrays.errors.WrongNode`.
"""

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


_ABSENT = frozenset((errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM))
"""Errors that mean a fact is not there to read in this process (no ``/proc``, a namespace
file hidden): the empty fact, which stays so. Any other error (too many open files, no
memory) is no answer: it raises, and the next call reads again."""
_FACTS = ("sys/kernel/random/boot_id", "self/ns/mnt", "self/ns/pid")


def _fact(path: str) -> str:
    """The fact at ``path``: a namespace's identity (``/proc/self/ns/``), or a file's text."""
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
    """This process's node id from the facts (boot, user, mount and pid namespaces), without
    the ``SHAREDARRAYS_NODE`` setting. Read once: the facts do not change while a process
    runs (a read that fails is not kept).

    Raises
    ------
    HandleUnavailable
        A fact could not be read now (e.g. this process has as many files open as it may):
        the next call reads again.
    """
    boot, mnt, pid = (_fact(f"/proc/{p}") for p in _FACTS)
    facts = "\0".join((boot, str(os.getuid()), mnt, pid))
    return hashlib.blake2b(facts.encode(), digest_size=16).hexdigest()


def this_node() -> str:
    """This process's node id: the one claimed by ``SHAREDARRAYS_NODE``, else
    :func:`machine_node`.

    Raises
    ------
    ValueError
        ``SHAREDARRAYS_NODE`` is set to something that is not a node id.
    HandleUnavailable
        As :func:`machine_node`.
    """
    claimed = env_word(
        NODE_VARIABLE, NODE_PATTERN, "a node id (at most 64 letters, digits or ._:-)"
    )
    return machine_node() if claimed is None else claimed
