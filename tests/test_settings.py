from __future__ import annotations

import pytest

from sharedarrays.settings import env_number

NAME = "SHAREDARRAYS_TEST_SETTING"


def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_number(NAME, 64, 0) == 64
    monkeypatch.setenv(NAME, "  ")
    assert env_number(NAME, 2.5, 0.0) == 2.5


def test_a_number_of_the_settings_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "12")
    value = env_number(NAME, 64, 0)
    assert value == 12 and type(value) is int
    monkeypatch.setenv(NAME, "0.25")
    assert env_number(NAME, 10.0, 0.0) == 0.25
    with pytest.raises(ValueError, match=rf"{NAME}='0.25' is not an integer; unset it"):
        env_number(NAME, 64, 0)
    monkeypatch.setenv(NAME, "lots")
    with pytest.raises(ValueError, match=rf"{NAME}='lots' is not a number"):
        env_number(NAME, 10.0, 0.0)


def test_below_the_minimum_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "0")
    with pytest.raises(ValueError, match=rf"{NAME} must be at least 1, got 0"):
        env_number(NAME, 1 << 30, 1)
    monkeypatch.setenv(NAME, "-1")
    with pytest.raises(ValueError, match=r"at least 0\.0"):
        env_number(NAME, 30.0, 0.0)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN"])
def test_a_number_that_is_not_finite_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    # (nan passed the minimum's comparison; inf made a keeper that never idled out)
    monkeypatch.setenv(NAME, text)
    with pytest.raises(ValueError, match=rf"{NAME}='{text}' is not a finite number"):
        env_number(NAME, 30.0, 0.0)
