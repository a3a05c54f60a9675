"""Handing an array's handles to this user's keeper, to name it or park it (``a.park()``),
and the namespace of this process's names (per project, or a setting), which qualifies each
keeper name as ``"namespace/name"`` so that two projects' names never meet."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from sharedarrays.api.arraybase import ArrayBase
from sharedarrays.errors import HandleUnavailable, NameNotFound, SettingError
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.reservation import close_fds
from sharedarrays.process import STATE
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.settings import env_word
from sharedarrays.transport import keeper

__all__ = ["NAMESPACE_VARIABLE", "PROJECT_MARKERS", "keep", "unpark"]
__all__ += ["local_name", "namespace", "shown", "whose"]

NAMESPACE_VARIABLE = "SHAREDARRAYS_NAMESPACE"
"""The setting that names this process's namespace (``/``: the global one)."""
PROJECT_MARKERS = (".git", "pyproject.toml")
"""What makes a directory a project's root, for the default namespace."""
_SETTING = re.compile(rf"/|[A-Za-z0-9][A-Za-z0-9._-]{{0,{keeper_protocol.MAX_NAMESPACE - 1}}}")


def namespace() -> str | None:
    """This process's namespace (``None``: the global one): ``SHAREDARRAYS_NAMESPACE`` if set
    (``/``: global), else the project's, the nearest directory up from the working directory
    with a ``.git`` or ``pyproject.toml``, as its name and a hash of its path
    (``"myproject-1a2b3c4d"``). ValueError for a setting that is not a namespace."""
    setting = env_word(
        NAMESPACE_VARIABLE,
        _SETTING,
        f"a namespace (1 to {keeper_protocol.MAX_NAMESPACE} characters from A-Z a-z 0-9 . _ -, "
        "starting with a letter or digit) or / (the global namespace)",
    )
    if setting is not None:
        return None if setting == "/" else setting
    return _project(_cwd())[1]


@functools.lru_cache(maxsize=16)
def _project(cwd: str) -> tuple[Path, str]:
    """The project directory of ``cwd`` (or ``cwd``, in none) and its namespace."""
    here = Path(cwd).resolve()
    marked = (d for d in (here, *here.parents) if any((d / m).exists() for m in PROJECT_MARKERS))
    root = next(marked, here)
    word = re.sub(r"[^A-Za-z0-9._-]", "_", root.name).lstrip("._-")[:40] or "root"
    return root, f"{word}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"


def whose() -> str:
    """Where this process's namespace comes from, for messages."""
    if os.environ.get(NAMESPACE_VARIABLE, "").strip():
        return f"set by {NAMESPACE_VARIABLE}"
    return f"of the project directory {_project(_cwd())[0]}"


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError as e:  # (removed under this process)
        raise SettingError(
            f"the working directory is gone ({e.strerror}), so it names no project: "
            f"change to a directory that exists, or set {NAMESPACE_VARIABLE}"
        ) from None


def local_name(key: str) -> str:
    """A keeper name as this process writes it: ``"name"`` here, else :func:`shown`."""
    space, slash, base = key.rpartition("/")
    return base if slash and space == namespace() else shown(key)


def shown(key: str) -> str:
    """A keeper name as it reaches the array from any namespace (``/name`` if global)."""
    return key if "/" in key else f"/{key}"


def keep(a: ArrayBase, name: str | None) -> None:
    """Give ``a``'s handles to the keeper (started if needed), under ``name`` or parked
    (``None``). ValueError for memory the keeper cannot hold; NameExists for a name taken."""
    alloc = a.allocation
    if alloc.backend.exporter_owned:
        raise ValueError(
            f"a {alloc.backend.name} array cannot be named or parked: its memory lives only as "
            "long as the process that made it, and the keeper holds fds, not processes. Make "
            "it with backend='cuda-vmm' (the default where the device supports it)"
        )
    if alloc.growable:
        raise ValueError(
            "a growable array (capacity=) cannot be named or parked: the keeper holds a "
            "fixed set of chunks. Keep its creator running while others load it"
        )
    chunks = alloc.chunk_sizes()
    if len(chunks) > keeper_protocol.MAX_CHUNKS:
        raise ValueError(
            f"the keeper holds arrays of at most {keeper_protocol.MAX_CHUNKS} chunks; this one has "
            f"{len(chunks)} (pass a larger chunk_bytes)"
        )
    doc = a.payload().to_doc()  # (its memory out of reuse now: the keeper may serve it to anyone)
    allow = None if alloc.allow_pids is None else sorted(alloc.allow_pids)
    req = keeper_protocol.Keep(alloc.id, alloc.secret, name, chunks, doc, allow)
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    try:
        status, body, fds = keeper.request(req, handles)
    finally:
        close_fds(temporary)
    close_fds(fds)
    what = f"cannot name the array {name!r}" if name else "cannot park the array"
    keeper.raise_for(status, body, what)
    keeper.hold(alloc.id)
    STATE.keeper.kept[alloc] = name


def unpark(alloc: Allocation) -> None:
    """Let the keeper drop a parked allocation (NameNotFound if it does not hold it)."""
    try:
        status, body, _ = keeper.request(
            keeper_protocol.Unlink(alloc_id=alloc.id, secret=alloc.secret), start=False
        )
    except HandleUnavailable:
        raise NameNotFound(f"allocation {alloc.id} is not parked: no keeper runs") from None
    keeper.raise_for(status, body, f"cannot unpark allocation {alloc.id}")
    STATE.keeper.kept.pop(alloc, None)
