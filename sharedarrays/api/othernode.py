"""A shared array of another node inside a message that distributed reads: a placeholder
whose use raises :class:`~sharedarrays.WrongNode`, so that the task fails and not the worker.

distributed pickles a task's specification with the arrays placed in it, and a worker
unpickles it while reading the scheduler's stream: a :class:`~sharedarrays.WrongNode` raised
there would close the connection and the task would never complete. So where, and only
where, distributed's unpickler loads a payload of another node (:func:`read_by_distributed`),
the load returns an :class:`OtherNodeArray`: the task fails when it uses the array, and the
worker stays. Pickled again, it is the payload it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from sharedarrays._cpython import frame_function
from sharedarrays.errors import WrongNode

__all__ = ["OtherNodeArray", "read_by_distributed"]

DISTRIBUTED_LOADS = ("distributed.protocol.pickle", "loads")
"""The module and function through which distributed unpickles everything it receives."""


def read_by_distributed(caller: FrameType | None) -> bool:
    """Whether ``caller`` (the frame that called the unpickler) is distributed's
    ``distributed.protocol.pickle.loads``."""
    return frame_function(caller) == DISTRIBUTED_LOADS


class OtherNodeArray:
    """A shared array of another node that reached this process in a message distributed
    read: any use raises :class:`~sharedarrays.WrongNode` (scatter the array first, instead).
    Pickled, it is the payload again (``rebuild`` and ``args`` of the pickle it came from).
    """

    __slots__ = ("_message", "_rebuild", "_args")

    def __init__(self, message: str, rebuild: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._message = message
        self._rebuild = rebuild
        self._args = args

    def refuse(self) -> NoReturn:
        """Raise the refusal: :class:`~sharedarrays.WrongNode`."""
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


def _refusing(name: str) -> Callable[..., NoReturn]:
    def use(self: OtherNodeArray, *args: Any, **kwargs: Any) -> NoReturn:
        self.refuse()

    use.__name__ = name
    use.__doc__ = "Using an array of another node: raises WrongNode."
    return use


_OPERATORS = (
    *("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow"),
    *("lshift", "rshift", "and", "xor", "or"),
)
_USES = (
    *("__array__", "__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__"),
    *("__contains__", "__float__", "__int__", "__index__", "__complex__", "__neg__"),
    *("__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"),
    *(f"__{op}__" for op in _OPERATORS),
    *(f"__r{op}__" for op in _OPERATORS),
    *(f"__i{op}__" for op in _OPERATORS if op != "divmod"),
)
"""Special methods (looked up on the type, not through ``__getattr__``) that refuse."""

for _name in _USES:
    setattr(OtherNodeArray, _name, _refusing(_name))
del _name
