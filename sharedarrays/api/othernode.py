"""A shared array of another node inside a message that distributed reads: a placeholder
whose use raises :class:`~sharedarrays.WrongNode`, so that the task fails and not the worker.

Why: distributed (2026.x) pickles a task's specification whole, with every array placed
directly in the task (``client.submit(f, a)``, ``client.map``, ``dask.delayed(f)(a)``, the
chunks of a :func:`sharedarrays.to_dask` graph) as its payload, and a worker unpickles it
while it reads the scheduler's message (``distributed.protocol.core.loads`` ->
``distributed.protocol.pickle.loads``). A payload of another node cannot be opened there;
raised at that point, :class:`~sharedarrays.WrongNode` escapes the worker's read of its
stream to the scheduler: the connection closes, the worker leaves the cluster and the task
never completes (the client's ``result()`` waits forever).

So where, and only where, distributed's own unpickler loads the payload
(:func:`read_by_distributed`: the function that called the unpickler is
``distributed.protocol.pickle.loads``, through which distributed reads every pickle it
receives: task specifications, graphs, results and data of its ``"pickle"`` family), the
refusal is deferred: the load returns an :class:`OtherNodeArray`, the message is read, and
the task runs and fails with the refusal's message when it uses the array (its attributes,
indexing, ``len``, iteration, NumPy conversion, arithmetic). distributed reports a task's
error to the client: ``future.result()`` raises that :class:`~sharedarrays.WrongNode`, and
the worker stays. Everywhere else (``pickle.loads`` in user code, multiprocessing, joblib,
Ray) a payload of another node still raises :class:`~sharedarrays.WrongNode` at once.

An :class:`OtherNodeArray` pickles as the payload it came from (nothing is lost): sent back
to a process of the array's node (a task's result, a scheduler that forwards a task) it
loads as the shared array there.
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
    """Whether ``caller``, the frame of the Python function that called the unpickler (a
    reconstructor's :func:`sharedarrays._cpython.caller_frame`: the unpickler is C code and
    has no frame), is distributed's ``distributed.protocol.pickle.loads``."""
    return frame_function(caller) == DISTRIBUTED_LOADS


class OtherNodeArray:
    """A shared array whose payload, made on another node, reached this process inside a
    message distributed read (see the module's notes): any use raises
    :class:`~sharedarrays.WrongNode` with the refusal's message (what to do: scatter the
    array first, ``client.submit(f, client.scatter(a))``). Pickled, it is the payload again.

    Parameters
    ----------
    message : str
        The refusal's message.
    rebuild, args
        The reconstructor and arguments of the pickle it came from.
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
        # a special name is looked up by protocols probing what an object supports (pickle,
        # dask's collection and tokenize checks, NumPy's and CuPy's array interfaces): not
        # there. Any other attribute (a.shape, a.get(), a.sum()) is a use.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self.refuse()


def _refusing(name: str) -> Callable[..., NoReturn]:
    def use(self: OtherNodeArray, *args: Any, **kwargs: Any) -> NoReturn:
        self.refuse()

    use.__name__ = name
    use.__doc__ = "Using an array of another node: raises WrongNode."
    return use


_OPERATORS = [
    *("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow"),
    *("lshift", "rshift", "and", "xor", "or"),
]
_USES = [
    *("__array__", "__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__"),
    *("__contains__", "__float__", "__int__", "__index__", "__complex__", "__neg__"),
    *("__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"),
    *(f"__{op}__" for op in _OPERATORS),
    *(f"__r{op}__" for op in _OPERATORS),
    *(f"__i{op}__" for op in _OPERATORS if op != "divmod"),
]
"""What using an array is, besides its attributes (special methods are looked up on the type,
not through ``__getattr__``): each raises the refusal."""

for _name in _USES:
    setattr(OtherNodeArray, _name, _refusing(_name))
del _name
