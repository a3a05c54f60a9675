"""The creation keywords become one frozen CreationOptions, checked once per array."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.options import CreationOptions
from sharedarrays.backends.device import Device

# keywords -> (error type, text of today's message): each one alone is refused
BAD_KEYWORDS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"device": "gpu"}, ValueError, "gpu"),
    ({"device": True}, TypeError, "not a bool"),
    ({"order": "K"}, ValueError, "order must be 'C' or 'F', not 'K'"),
    ({"capacity": 2**47 + 1}, sa.OutOfMemory, "at most 140737488355328 bytes"),
    ({"capacity": 1.5}, TypeError, ""),
    ({"capacity": 4096, "pack": True}, ValueError, "pack=True and capacity cannot be combined"),
    ({"capacity": 4096, "name": "grow"}, ValueError, "a named array cannot be growable"),
    ({"capacity": 4096, "order": "F"}, ValueError, "must be in C order"),
    ({"name": "no spaces"}, ValueError, "no spaces"),
    ({"name": 7}, TypeError, "an array name is a str, not int"),
    ({"allow_pids": [0]}, ValueError, "allow_pids are process ids"),
    ({"allow_pids": [1, 2**64]}, ValueError, "allow_pids are process ids"),
    ({"allow_pids": ["1"]}, TypeError, ""),
    ({"allow_pids": [1], "pack": True}, ValueError, "cannot be combined with name, allow_pids"),
    ({"readonly": True, "pack": True}, ValueError, "cannot be combined with name, allow_pids"),
    ({"name": "x", "pack": True}, ValueError, "cannot be combined with name, allow_pids"),
    ({"access": "cpu"}, TypeError, "access= takes a list of devices"),
    ({"access": [("cpu", "rw", 1)]}, ValueError, "access= items are devices or (device, mode)"),
    ({"access": [("cpu", "w")]}, ValueError, "access mode must be 'rw' or 'r', not 'w'"),
    ({"access": [("cpu", "r")]}, ValueError, "is the memory's own device"),
    ({"pack": True, "chunk_bytes": 4096}, ValueError, "pack=True and chunk_bytes cannot be"),
]


def _ids(case: tuple[dict[str, Any], type[Exception], str]) -> str:
    return ",".join(case[0])


@pytest.mark.parametrize(("keywords", "error", "text"), BAD_KEYWORDS, ids=map(_ids, BAD_KEYWORDS))
def test_each_bad_keyword_is_refused_with_todays_error(
    keywords: dict[str, Any], error: type[Exception], text: str
) -> None:
    keywords = {"device": "cpu", **keywords}
    with pytest.raises(error) as by_options:
        CreationOptions.from_keywords(**keywords)
    assert text in str(by_options.value)
    makers: list[Callable[[], sa.SharedDeviceArray]] = [
        lambda: sa.empty(8, **keywords),
        lambda: sa.zeros(8, **keywords),
        lambda: sa.full(8, 2.0, **keywords),
    ]
    for make in makers:
        with pytest.raises(error) as by_function:
            make()
        assert str(by_function.value) == str(by_options.value)
    if "order" not in keywords:  # from_array takes its layout from the source
        with pytest.raises(error) as by_copy:
            sa.from_array(np.arange(8.0), **keywords)
        assert str(by_copy.value) == str(by_options.value)


def test_an_unknown_keyword_is_a_type_error() -> None:
    for make in (sa.empty, sa.zeros, sa.zeros_like, sa.from_array):
        with pytest.raises(TypeError, match="unexpected keyword argument 'devic'"):
            make(4, devic="cpu")  # type: ignore[call-arg]


def test_what_depends_on_the_array_is_checked_when_it_is_made() -> None:
    options = CreationOptions.from_keywords(device="cpu", capacity=16)
    assert options.capacity == 16 and options.pack is False
    with pytest.raises(ValueError, match="does not hold the 64 bytes of shape"):
        sa.empty(8, device="cpu", capacity=16)
    with pytest.raises(ValueError, match="a 0-d array cannot grow"):
        sa.empty((), device="cpu", capacity=4096)


def test_the_record_is_frozen_and_normalised() -> None:
    options = CreationOptions.from_keywords(
        device="cpu",
        allow_pids=[5, 5, 7],
        readonly=1,  # type: ignore[arg-type]
        pack=None,
    )
    assert options.device == Device("cpu", 0)
    assert options.allow_pids == frozenset({5, 7})
    assert options.readonly is True
    assert options.pack is False  # restricted arrays are never packed
    assert dict(options.peers) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.readonly = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.peers[1] = "rw"  # type: ignore[index]


def test_packing_is_left_to_the_size_unless_a_keyword_decides() -> None:
    def pack(**keywords: Any) -> bool | None:
        return CreationOptions.from_keywords(device="cpu", **keywords).pack

    assert pack() is None
    assert pack(pack=True) is True and pack(pack=False) is False
    assert pack(chunk_bytes=4096) is None  # not packed: the size decides with chunk_bytes
    deciding: list[dict[str, Any]] = [
        {"name": "n"},
        {"allow_pids": []},
        {"readonly": True},
        {"capacity": 64},
    ]
    for keywords in deciding:
        assert pack(**keywords) is False, keywords


@pytest.mark.parametrize(
    "make",
    [
        lambda: sa.empty(4, device="cpu"),
        lambda: sa.zeros(4, device="cpu"),
        lambda: sa.ones(4, device="cpu"),
        lambda: sa.full(4, 3, device="cpu"),
        lambda: sa.from_array(np.arange(4), device="cpu"),
    ],
    ids=["empty", "zeros", "ones", "full", "from_array"],
)
def test_the_keywords_are_checked_once_per_array(
    make: Callable[[], sa.SharedDeviceArray], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[CreationOptions] = []
    original = CreationOptions.from_keywords.__func__  # type: ignore[attr-defined]

    def spy(cls: type[CreationOptions], /, **keywords: Any) -> CreationOptions:
        built.append(original(cls, **keywords))
        return built[-1]

    monkeypatch.setattr(CreationOptions, "from_keywords", classmethod(spy))
    a = make()
    try:
        assert len(built) == 1
        assert a.device == built[0].device
    finally:
        a.close()


def test_from_array_keeps_a_fortran_layout_in_its_options() -> None:
    src = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    a = sa.from_array(src, device="cpu")
    try:
        assert a.array.flags.f_contiguous and not a.array.flags.c_contiguous
        assert a.get().tolist() == src.tolist()
    finally:
        a.close()
