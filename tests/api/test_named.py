"""Namespaces of named arrays: a project's names never meet another project's (issue 48.3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from keeper_helpers import private_keeper, py, run_cli

import sharedarrays as sa
from sharedarrays.api import named
from sharedarrays.process import STATE

__all__ = ["private_keeper"]  # a fixture, used by name

pytestmark = pytest.mark.timeout(180)


def _project(base: Path, name: str) -> Path:
    """A project directory (a git checkout's root) with a notebooks/ folder."""
    root = base / name
    (root / ".git").mkdir(parents=True)
    (root / "notebooks").mkdir()
    return root


def _make(value: float, name: str = "demo-state") -> str:
    """Code that makes a named array of 3 ``value``s and exits (the keeper keeps it)."""
    return (
        "import sharedarrays as sa\n"
        f"a = sa.full(3, {value}, device='cpu', name={name!r})\n"
        "a.close()"
    )


def _read(name: str = "demo-state") -> str:
    """Code that attaches ``name`` and prints its first value, or the NameNotFound message."""
    return (
        "import sharedarrays as sa\n"
        "try:\n"
        f"    print(sa.attach({name!r}).get()[0])\n"
        "except sa.NameNotFound as e:\n"
        "    print('NameNotFound:', e)"
    )


@pytest.fixture(autouse=True)
def _no_namespace_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHAREDARRAYS_NAMESPACE", raising=False)


def test_a_projects_notebooks_share_its_namespace_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = _project(tmp_path, "one"), _project(tmp_path, "two")
    (one / "notebooks" / "deeper").mkdir()
    assert named.namespace() is not None
    spaces = {}
    for where in (one, one / "notebooks", one / "notebooks" / "deeper", two):
        monkeypatch.chdir(where)
        spaces[where] = named.namespace()
    assert spaces[one] == spaces[one / "notebooks"] == spaces[one / "notebooks" / "deeper"]
    assert spaces[one] != spaces[two]
    assert re.fullmatch(r"one-[0-9a-f]{8}", spaces[one] or ""), spaces
    # a directory in no project: its own namespace
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.chdir(plain)
    assert named.namespace() not in (spaces[one], spaces[two])


def test_two_projects_names_never_meet(private_keeper: Path, tmp_path: Path) -> None:
    one, two = _project(tmp_path, "one"), _project(tmp_path, "two")
    py(_make(1.0), cwd=one)
    py(_make(2.0), cwd=two)  # (main: NameExists, both projects' names were one)
    # each project's notebooks (and scripts at its root) find their own project's array
    assert py(_read(), cwd=one / "notebooks").stdout.strip() == "1.0"
    assert py(_read(), cwd=two / "notebooks").stdout.strip() == "2.0"
    # unlinking one project's name leaves the other's
    py("import sharedarrays as sa; sa.unlink('demo-state')", cwd=one)
    assert py(_read(), cwd=two).stdout.strip() == "2.0"
    py("import sharedarrays as sa; sa.unlink('demo-state')", cwd=two)


def test_attach_says_which_namespace_has_the_name(
    private_keeper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = _project(tmp_path, "other")
    py(_make(5.0, "frames"), cwd=other / "notebooks")
    monkeypatch.chdir(other)
    theirs = named.namespace()
    monkeypatch.chdir(_project(tmp_path, "mine"))
    with pytest.raises(sa.NameNotFound) as e:
        sa.attach("frames")
    message = str(e.value)
    assert f"namespace {named.namespace()!r}" in message  # where it looked
    assert f"'{theirs}/frames'" in message  # where it is, and the name that reaches it
    assert f"SHAREDARRAYS_NAMESPACE={theirs}" in message
    with pytest.raises(sa.NameNotFound, match=f"'{theirs}/frames'"):
        sa.unlink("frames")
    # the name in the message reaches it
    a = sa.attach(f"{theirs}/frames")
    np.testing.assert_array_equal(a.get(), [5.0, 5.0, 5.0])
    assert STATE.keeper.kept[a.allocation] == f"{theirs}/frames"
    # so does the setting
    monkeypatch.setenv("SHAREDARRAYS_NAMESPACE", theirs)
    assert sa.attach("frames").allocation is a.allocation
    sa.unlink("frames")
    monkeypatch.delenv("SHAREDARRAYS_NAMESPACE")
    with pytest.raises(sa.NameNotFound, match="none was made there, or it was unlinked"):
        sa.attach("frames")


def test_global_names(
    private_keeper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_project(tmp_path, "one"))
    g = sa.zeros(2, device="cpu", name="/shared")
    assert STATE.keeper.kept[g.allocation] == "shared"  # a global name is held as it is
    monkeypatch.chdir(_project(tmp_path, "two"))
    assert sa.attach("/shared").allocation is g.allocation  # from any project
    with pytest.raises(sa.NameNotFound, match=r"it exists as '/shared'.*NAMESPACE=/ "):
        sa.attach("shared")
    monkeypatch.setenv("SHAREDARRAYS_NAMESPACE", "/")  # every name of this process global
    assert named.namespace() is None
    assert sa.attach("shared").allocation is g.allocation
    assert [(n.name, n.namespace, n.qualified) for n in sa.list_named()] == [
        ("shared", None, "/shared")
    ]
    sa.unlink("shared")


def test_list_named_shows_this_namespace_unless_asked_for_all(
    private_keeper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = _project(tmp_path, "one"), _project(tmp_path, "two")
    py(_make(1.0), cwd=one)
    py(_make(2.0), cwd=two)
    py(_make(3.0, "/demo-state"), cwd=two)
    monkeypatch.chdir(one)
    mine = named.namespace()
    (info,) = sa.list_named()
    assert (info.name, info.namespace, info.qualified) == ("demo-state", mine, f"{mine}/demo-state")
    everything = sa.list_named(all_namespaces=True)
    assert sorted(n.qualified or "" for n in everything) == sorted(
        ["/demo-state", f"{mine}/demo-state", f"{py_namespace(two)}/demo-state"]
    )
    for name in ("demo-state", f"{py_namespace(two)}/demo-state", "/demo-state"):
        sa.unlink(name)
    assert sa.list_named(all_namespaces=True) == []


def py_namespace(cwd: Path) -> str:
    """The namespace a process started in ``cwd`` uses."""
    return py(
        "from sharedarrays.api import named; print(named.namespace())", cwd=cwd
    ).stdout.strip()


def test_ls_has_a_namespace_column_and_all_namespaces(
    private_keeper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = _project(tmp_path, "one"), _project(tmp_path, "two")
    py(_make(1.0, "here"), cwd=one)
    py(_make(2.0, "there"), cwd=two)
    monkeypatch.chdir(one)
    mine, theirs = named.namespace(), py_namespace(two)
    out = run_cli("ls")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert "NAMESPACE" in header.split()
    assert len(rows) == 1 and rows[0].split()[:2] == ["here", mine]
    out = run_cli("ls", "--all-namespaces", "--json")
    assert out.returncode == 0, out.stderr
    found = {(r["namespace"], r["name"]) for r in map(json.loads, out.stdout.splitlines())}
    assert found == {(mine, "here"), (theirs, "there")}
    assert run_cli("rm", f"{theirs}/there").returncode == 0
    assert run_cli("rm", "here").returncode == 0
    assert run_cli("ls", "-A").stdout.splitlines()[1:] == []


@pytest.mark.parametrize("name", ["a", "ns/a", "/a", "N.s_1-x/a.b", "x" * 64 + "/" + "y" * 128])
def test_valid_names(name: str) -> None:
    assert named.check_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "/", "a/", "a/b/c", "//a", "../a", ".ns/a", "x" * 65 + "/a", "/" + "y" * 129]
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid array name"):
        named.check_name(name)
    with pytest.raises(ValueError, match="invalid array name"):
        sa.zeros(2, device="cpu", name=name)


@pytest.mark.parametrize("value", ["a/b", ".x", "x" * 65, "has space"])
def test_a_bad_namespace_setting_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("SHAREDARRAYS_NAMESPACE", value)
    with pytest.raises(ValueError, match=r"SHAREDARRAYS_NAMESPACE=.*is not a namespace"):
        sa.attach("x")


def test_a_removed_working_directory_or_a_bad_setting_is_a_setting_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No raw FileNotFoundError from os.getcwd(), no bare ValueError from a setting."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    monkeypatch.delenv("SHAREDARRAYS_NAMESPACE", raising=False)
    with pytest.raises(sa.SharedArrayError, match="working directory is gone"):
        named.namespace()
    monkeypatch.setenv("SHAREDARRAYS_NAMESPACE", "no spaces allowed")
    with pytest.raises(sa.SharedArrayError, match="SHAREDARRAYS_NAMESPACE"):
        named.namespace()
