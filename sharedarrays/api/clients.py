"""What other libraries need to take a shared array where they take the array it wraps.

Most take it as it is (NumPy's dispatch, ``__array__``, DLPack, the CUDA Array Interface).
torch's ``default_collate`` (a ``DataLoader``'s) looks elements up by type in
``default_collate_fn_map``: :func:`install` adds :func:`collate` there, at once if torch's
collate module is imported, else from a :data:`sys.meta_path` finder once it is; nothing
here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from sharedarrays.api.array import SharedDeviceArray

if TYPE_CHECKING:
    from importlib.abc import Loader as _Loader
    from importlib.abc import MetaPathFinder as _MetaPathFinder
else:  # (importing importlib.abc costs some 5 ms; only methods are asked for)
    _Loader = _MetaPathFinder = object

__all__ = ["install", "register_collate", "collate"]

_COLLATE = "torch.utils.data._utils.collate"


def collate(
    batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    """torch's ``default_collate`` of shared arrays, as of their native arrays (CuPy ones
    through DLPack, no copy)."""
    import torch
    from torch.utils.data._utils.collate import collate as torch_collate
    from torch.utils.dlpack import from_dlpack

    natives = [x.array if isinstance(x, SharedDeviceArray) else x for x in batch]
    if not isinstance(natives[0], (np.ndarray, torch.Tensor)):
        natives = [from_dlpack(x) for x in natives]
    return torch_collate(natives, collate_fn_map=collate_fn_map)


def register_collate(module: ModuleType) -> None:
    """Add :func:`collate` to ``module``'s (torch's collate module) ``default_collate_fn_map``
    for shared arrays."""
    module.default_collate_fn_map[SharedDeviceArray] = collate


def install() -> None:
    """Register with torch's ``default_collate`` now or once it is imported. Idempotent."""
    module = sys.modules.get(_COLLATE)
    if module is not None:
        register_collate(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_COLLATE, register_collate))


class _AfterImport(_MetaPathFinder):
    """Calls ``hook(module)`` once the module ``name`` has run, then leaves
    :data:`sys.meta_path`: the other finders' spec, its loader wrapped."""

    def __init__(self, name: str, hook: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._hook = hook

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self._name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for finder in list(sys.meta_path):  # (the others, as the import system asks them)
            find = getattr(finder, "find_spec", None)
            spec = cast(ModuleSpec | None, None if find is None else find(fullname, path, target))
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self._hook)
        return spec


class _ThenCall(_Loader):
    """A loader that runs ``loader``'s module, then calls ``hook`` with it."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._hook(module)
