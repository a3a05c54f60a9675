"""sharedarrays.api.othernode: the placeholder of an array of another node that distributed's
unpickler read, and how the reconstructor tells distributed's unpickler from any other.
(The placeholder on a real worker of another node: tests/api/test_dask.py.)"""

from __future__ import annotations

import operator
import pickle
import sys
from types import FrameType
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.othernode import OtherNodeArray, read_by_distributed

pytestmark = pytest.mark.timeout(60)

_rebuilt: list[tuple[Any, ...]] = []


def _rebuild(*args: Any) -> str:
    _rebuilt.append(args)
    return "rebuilt"


def _placeholder() -> OtherNodeArray:
    return OtherNodeArray("made on node far: scatter it first", _rebuild, (b"payload", 7))


USES = {
    "attribute": lambda p: p.shape,
    "method": lambda p: p.get(),
    "index": lambda p: p[0],
    "assign": lambda p: operator.setitem(p, 0, 1),
    "len": len,
    "iter": iter,
    "float": float,
    "asarray": np.asarray,
    "numpy function": np.sum,
    "ufunc": lambda p: np.add(p, 1),
    "add": lambda p: p + 1,
    "radd": lambda p: 1 + p,
    "iadd": lambda p: operator.iadd(p, 1),
    "matmul": lambda p: p @ p,
    "compare": lambda p: p < 1,
    "negate": operator.neg,
}


@pytest.mark.parametrize("use", list(USES.values()), ids=list(USES))
def test_any_use_raises_the_refusal(use: Any) -> None:
    with pytest.raises(sa.WrongNode, match="made on node far: scatter it first"):
        use(_placeholder())


def test_probes_find_nothing_and_it_pickles_as_what_it_came_from() -> None:
    p = _placeholder()
    for probe in ("__dask_graph__", "__dask_tokenize__", "__cuda_array_interface__"):
        assert not hasattr(p, probe)  # a protocol's probe: absent, not a refusal
    assert "WrongNode" in repr(p)
    _rebuilt.clear()
    assert pickle.loads(pickle.dumps(p)) == "rebuilt"
    assert _rebuilt == [(b"payload", 7)]


class _Caller:
    """Pickles as a call that records the frame of the function that called the unpickler."""

    frames: list[FrameType | None] = []

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _record_caller, ()


def _record_caller() -> None:
    _Caller.frames.append(sys._getframe(1))


def test_read_by_distributed_names_distributed_unpickler_only() -> None:
    protocol = pytest.importorskip(
        "distributed.protocol", reason="pip install 'sharedarrays[dask]'"
    )
    blob = pickle.dumps(_Caller())
    _Caller.frames.clear()
    pickle.loads(blob)  # user code
    protocol.pickle.loads(blob)  # how distributed reads every pickle it receives
    protocol.deserialize(*protocol.serialize(_Caller(), serializers=("pickle",)))
    user, direct, family = _Caller.frames
    assert not read_by_distributed(user)
    assert read_by_distributed(direct) and read_by_distributed(family)
    assert not read_by_distributed(None)
