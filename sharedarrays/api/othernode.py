"""A shared array of another node in a message distributed reads loads as a placeholder whose
use raises :class:`~sharedarrays.WrongNode`, so that the task fails, not the worker (raised
while a worker reads the scheduler's stream, it would close the connection)."""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from sharedarrays._cpython import frame_function
from sharedarrays.errors import WrongNode

__all__ = ["OtherNodeArray", "read_by_distributed"]

DISTRIBUTED_LOADS = ("distributed.protocol.pickle", "loads")  # (it unpickles all it receives)


def read_by_distributed(caller: FrameType | None) -> bool:
    """Whether ``caller`` (the frame that called the unpickler) is distributed's ``loads``."""
    return frame_function(caller) == DISTRIBUTED_LOADS


class OtherNodeArray:
    """Another node's shared array in a message distributed read: any use raises
    :class:`~sharedarrays.WrongNode` (scatter the array instead); it pickles as it came."""

    __slots__ = ("_message", "_rebuild", "_args")

    def __init__(self, message: str, rebuild: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._message = message
        self._rebuild = rebuild
        self._args = args

    def refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise WrongNode(self._message)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self._rebuild, self._args

    def __repr__(self) -> str:
        return "<OtherNodeArray: a shared array of another node; using it raises WrongNode>"

    def __getattr__(self, name: str) -> Any:
        # (special names are protocols probing what the object supports: not a use)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self.refuse()


_OPERATORS = (
    *("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow"),
    *("lshift", "rshift", "and", "xor", "or"),
)
# special methods (looked up on the type, not through __getattr__) that refuse
for _name in (
    *("__array__", "__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__"),
    *("__contains__", "__float__", "__int__", "__index__", "__complex__", "__neg__"),
    *("__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"),
    *(f"__{op}__" for op in _OPERATORS),
    *(f"__r{op}__" for op in _OPERATORS),
    *(f"__i{op}__" for op in _OPERATORS if op != "divmod"),
):
    setattr(OtherNodeArray, _name, OtherNodeArray.refuse)
del _name
