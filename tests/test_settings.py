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


def test_every_number_setting_is_in_the_table() -> None:
    # (check_environment reads the table: a setting read elsewhere but missing there would be
    # refused only where it is first read, at exit or at a release)
    import re
    from pathlib import Path

    from sharedarrays import settings

    package = Path(settings.__file__).parent
    read = set()
    for path in package.rglob("*.py"):
        read |= set(re.findall(r'env_number\(\s*"(SHAREDARRAYS_\w+)"', path.read_text()))
    assert read and read == set(settings.NUMBERS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SHAREDARRAYS_IN_FLIGHT", "abc"),
        ("SHAREDARRAYS_KEEP_IMPORTS", "-1"),
        ("SHAREDARRAYS_KEEPER_IDLE", "nan"),
        ("SHAREDARRAYS_CHUNK_BYTES", "1.5"),
    ],
)
def test_a_bad_number_is_refused_as_the_package_is_imported(name: str, value: str) -> None:
    # (IN_FLIGHT=abc was read only at exit: a traceback there and the payload lost;
    # KEEP_IMPORTS=abc at a release: a warning, the mapping kept; KEEPER_IDLE=abc: the
    # keeper did not start, HandleUnavailable)
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", "import sharedarrays"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, name: value},
    )
    assert r.returncode != 0
    assert "ValueError" in r.stderr and name in r.stderr


@pytest.mark.timeout(60)
def test_a_misspelt_setting_is_named_with_the_setting_it_is_closest_to() -> None:
    # (a SHAREDARRAYS_* variable that is no setting was ignored without a word: a user who
    # typed SHAREDARRAYS_IN_FLIGTH=300 kept the 60 s default and never knew)
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAREDARRAYS_")}
    env.update(
        PYTHONPATH=str(root),
        SHAREDARRAYS_IN_FLIGTH="300",
        SHAREDARRAYS_WHATEVER="1",
        SHAREDARRAYS_KEEP_IMPORTS="8",  # (a setting: no word of it)
    )
    proc = subprocess.run(
        [sys.executable, "-c", "import sharedarrays"],
        capture_output=True, text=True, timeout=50, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 2, proc.stderr
    assert (
        "SHAREDARRAYS_IN_FLIGTH is not a sharedarrays setting (did you mean "
        "SHAREDARRAYS_IN_FLIGHT?): it is ignored" in proc.stderr
    )
    assert "SHAREDARRAYS_WHATEVER is not a sharedarrays setting: it is ignored" in proc.stderr
    assert "SHAREDARRAYS_KEEP_IMPORTS is not" not in proc.stderr


def test_every_setting_the_package_names_is_known() -> None:
    # (check_environment warns of any other SHAREDARRAYS_* variable: a setting the package
    # reads but the tables lack would be warned of as ignored)
    import re
    from pathlib import Path

    from sharedarrays import settings

    package = Path(settings.__file__).parent
    named = set()
    for path in package.rglob("*.py"):
        named |= set(re.findall(r'"(SHAREDARRAYS_[A-Z_]+)"', path.read_text()))
    named.discard("SHAREDARRAYS_CPU_ADDRESSABLE")  # (an attribute of an Ascend stand-in module)
    known = {*settings.NUMBERS, *settings.WORDS, *settings.TOOLS}
    assert named and named <= known, named - known
