"""The namespace of this process's array names (per project, or a setting): a process
qualifies each keeper name as ``"namespace/name"``, so that two projects' names never meet."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from sharedarrays.errors import SettingError
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.settings import env_word

__all__ = ["NAMESPACE_VARIABLE", "PROJECT_MARKERS", "local_name", "namespace", "shown", "whose"]

NAMESPACE_VARIABLE = "SHAREDARRAYS_NAMESPACE"
"""The setting that names this process's namespace (``/``: the global one)."""
PROJECT_MARKERS = (".git", "pyproject.toml")
"""What makes a directory a project's root, for the default namespace."""
MAX_NAMESPACE = keeper_protocol.MAX_NAMESPACE
_SETTING = re.compile(rf"/|[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAMESPACE - 1}}}")


def namespace() -> str | None:
    """The namespace this process's names are in (``None``: the global namespace).

    ``SHAREDARRAYS_NAMESPACE`` if set (``/``: global); else the project's: the nearest
    directory up from the working directory holding a ``.git`` or ``pyproject.toml``, as its
    base name and a hash of its path (``"myproject-1a2b3c4d"``). ValueError for a setting
    that is not a namespace.
    """
    setting = env_word(
        NAMESPACE_VARIABLE,
        _SETTING,
        f"a namespace (1 to {MAX_NAMESPACE} characters from A-Z a-z 0-9 . _ -, "
        "starting with a letter or digit) or / (the global namespace)",
    )
    if setting is not None:
        return None if setting == "/" else setting
    return _project_namespace(_cwd())


@functools.lru_cache(maxsize=16)
def _project_root(cwd: str) -> Path:
    here = Path(cwd).resolve()
    for directory in (here, *here.parents):
        if any((directory / marker).exists() for marker in PROJECT_MARKERS):
            return directory
    return here


@functools.lru_cache(maxsize=16)
def _project_namespace(cwd: str) -> str:
    root = _project_root(cwd)
    word = re.sub(r"[^A-Za-z0-9._-]", "_", root.name).lstrip("._-")[:40] or "root"
    return f"{word}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"


def whose() -> str:
    """Where this process's namespace comes from, for messages."""
    if os.environ.get(NAMESPACE_VARIABLE, "").strip():
        return f"set by {NAMESPACE_VARIABLE}"
    return f"of the project directory {_project_root(_cwd())}"


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError as e:  # (removed under this process)
        raise SettingError(
            f"the working directory is gone ({e.strerror}), so it names no project: "
            f"change to a directory that exists, or set {NAMESPACE_VARIABLE}"
        ) from None


def local_name(key: str) -> str:
    """A keeper name as this process writes it: ``"name"`` in this namespace, else
    :func:`shown`."""
    space, slash, base = key.rpartition("/")
    here = namespace() if slash else None
    return base if slash and space == here else shown(key)


def shown(key: str) -> str:
    """A keeper name as it reaches the array from any namespace (``/name`` if global)."""
    return key if "/" in key else f"/{key}"
