"""torch's ``default_collate`` for shared arrays: :func:`install` adds :func:`collate` to its
``default_collate_fn_map``, now or (a :data:`sys.meta_path` hook) once torch imports it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from sharedarrays.api.array import SharedDeviceArray

if TYPE_CHECKING:
    from importlib.abc import Loader, MetaPathFinder

    class _Hook(MetaPathFinder, Loader): ...

else:  # (importing importlib.abc costs some 5 ms; only methods are asked for)
    _Hook = object

__all__ = ["install", "collate"]

_COLLATE = "torch.utils.data._utils.collate"


def collate(
    batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    """torch's ``default_collate`` of the native arrays (CuPy ones through DLPack, no copy)."""
    import torch
    from torch.utils.data._utils.collate import collate as torch_collate
    from torch.utils.dlpack import from_dlpack

    natives = [x.array if isinstance(x, SharedDeviceArray) else x for x in batch]
    if not isinstance(natives[0], (np.ndarray, torch.Tensor)):
        natives = [from_dlpack(x) for x in natives]
    return torch_collate(natives, collate_fn_map=collate_fn_map)


def install() -> None:
    """Register with torch's ``default_collate`` now or once it is imported. Idempotent."""
    module = sys.modules.get(_COLLATE)
    if module is not None:
        module.default_collate_fn_map[SharedDeviceArray] = collate
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(_Hook):
    """Finds torch's collate module with the other finders, runs it as its loader, registers
    :func:`collate`; leaves :data:`sys.meta_path` once asked."""

    _loader: Any = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _COLLATE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)  # (the other finders, as for the import)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        module.default_collate_fn_map[SharedDeviceArray] = collate
