"""The one table of fork and exit hooks (sharedarrays/process.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forking import in_forked_child

from sharedarrays import process

PACKAGE = Path(__file__).resolve().parents[1] / "sharedarrays"


def calls(path: Path, names: set[str]) -> list[str]:
    """Calls of ``names`` (as ``module.attr``) in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            value = node.func.value
            if isinstance(value, ast.Name) and f"{value.id}.{node.func.attr}" in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_one_fork_hook_and_one_atexit_registration_in_the_package() -> None:
    fork = [c for p in sorted(PACKAGE.rglob("*.py")) for c in calls(p, {"os.register_at_fork"})]
    exits = [c for p in sorted(PACKAGE.rglob("*.py")) for c in calls(p, {"atexit.register"})]
    assert fork == ["sharedarrays/process.py:" + fork[0].rsplit(":", 1)[1]], fork
    assert len(exits) == 1 and exits[0].startswith("sharedarrays/process.py:"), exits


def test_hooks_run_by_layer_whatever_the_registration_order() -> None:
    ran: list[str] = []
    table = process._Hooks()

    def hook(name: str):  # type: ignore[no-untyped-def]
        def fn() -> None:
            ran.append(name)

        fn.__qualname__ = name
        return fn

    c = {n: hook(n) for n in ("transport", "memory", "backends-1", "backends-0")}
    before, child, _ = process.FORK
    fork = process._Hook
    table.add(
        fork("transport", 0, hook("b-transport"), before),
        fork("transport", 0, c["transport"], child),
    )
    table.add(fork("memory", 0, c["memory"], child))
    table.add(fork("backends", 1, c["backends-1"], child))
    table.add(
        fork("backends", 0, hook("b-backends"), before), fork("backends", 0, c["backends-0"], child)
    )
    table.run_fork(before)
    assert ran == ["b-transport", "b-backends"]  # top layer first
    ran.clear()
    table.run_fork(child)
    assert ran == ["backends-0", "backends-1", "memory", "transport"]  # bottom layer first
    ran.clear()
    table.add(process._Hook("memory", 0, hook("x-memory")))
    table.add(process._Hook("transport", 2, hook("x-shutdown"), processes=False))
    table.add(process._Hook("transport", 0, hook("x-hand-over")))
    table.add(process._Hook("api", 0, hook("x-api")))
    table.run_exit()
    assert ran == ["x-api", "x-hand-over", "x-shutdown", "x-memory"]  # top layer first
    ran.clear()
    table.run_exit(processes_only=True)
    assert ran == ["x-api", "x-hand-over", "x-memory"]


def test_a_failing_hook_does_not_stop_the_others(capfd: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    table = process._Hooks()

    def boom() -> None:
        raise RuntimeError("boom")

    table.add(process._Hook("transport", 0, boom))
    table.add(process._Hook("memory", 0, lambda: ran.append("memory")))
    table.run_exit()
    assert ran == ["memory"]
    assert "boom" in capfd.readouterr().err


def test_registering_twice_is_idempotent_and_a_conflict_is_refused() -> None:
    table = process._Hooks()

    def a() -> None: ...

    def b() -> None: ...

    child, parent = process.FORK[1:]
    table.add(process._Hook("memory", 0, a, child))
    table.add(process._Hook("memory", 0, a, child))
    assert len(table.fork) == 1
    with pytest.raises(ValueError, match="registered at fork already"):
        table.add(process._Hook("transport", 0, a, child), process._Hook("transport", 0, b, parent))
    table.add(process._Hook("memory", 0, b))
    table.add(process._Hook("memory", 0, b))
    assert len(table.exit) == 1
    with pytest.raises(ValueError, match="at exit already"):
        table.add(process._Hook("memory", 1, b))


def test_the_public_functions_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="layer must be one of"):
        process.at_fork("kernel", after_in_child=lambda: None)
    with pytest.raises(ValueError, match="at least one hook"):
        process.at_fork("memory")
    with pytest.raises(ValueError, match="layer must be one of"):
        process.at_exit(lambda: None, "kernel")
    saved = list(process.STATE.hooks.fork)

    def hook() -> None:
        pass

    try:
        process.at_fork("memory", after_in_child=hook)
        registered = (list(process.STATE.hooks.fork), list(process.STATE.hooks.exit))
        process.at_fork("memory", after_in_child=hook)  # again: nothing changes
        assert (process.STATE.hooks.fork, process.STATE.hooks.exit) == registered
    finally:
        process.STATE.hooks.fork = saved


def test_the_package_hooks_are_in_layer_order() -> None:
    import sharedarrays  # noqa: F401 - registers every hook

    names = [(h.layer, process._name(h.fn)) for h in process.STATE.hooks.fork]
    layers = [layer for layer, _ in names]
    assert layers == sorted(layers, key=process.LAYERS.index)
    assert [n for _, n in names] == [
        "sharedarrays.backends.cuda.driver._after_fork_in_parent",
        "sharedarrays.backends.cuda.driver._before_fork",
        "sharedarrays.memory.cache._keep_inherited_memory_from_reuse",
    ]
    exits = [process._name(h.fn) for h in process.STATE.hooks.exit]
    assert exits == [
        "sharedarrays.transport.keeper._hand_over_at_exit",
        "sharedarrays.transport.server.tell_loads",
        "sharedarrays.transport.handles._drain_at_exit",
        "sharedarrays.transport.handles.shutdown_server",
        "sharedarrays.transport.client.close_connections",
        "sharedarrays.transport.keeper._close_at_exit",
        "sharedarrays.memory.cache._release_at_exit",
    ]


def test_a_forked_child_runs_the_child_hooks_once_in_order() -> None:
    ran: list[str] = []
    saved = list(process.STATE.hooks.fork)

    def first() -> None:
        ran.append("backends")

    def second() -> None:
        ran.append("transport")

    try:
        process.at_fork("transport", order=99, after_in_child=second)
        process.at_fork("backends", order=-99, after_in_child=first)
        assert in_forked_child(lambda: ran) == ["backends", "transport"]
        assert ran == []  # not in the parent
    finally:
        process.STATE.hooks.fork = saved


def test_the_pid_is_this_process_s_also_in_a_forked_child_and_its_hooks() -> None:
    seen: list[int] = []
    saved = list(process.STATE.hooks.fork)

    def hook() -> None:
        seen.append(process.STATE.pid)

    try:
        process.at_fork("backends", order=-99, after_in_child=hook)
        assert process.STATE.pid == os.getpid()
        child = in_forked_child(lambda: (process.STATE.pid, os.getpid(), list(seen)))
    finally:
        process.STATE.hooks.fork = saved
    pid, real, in_hook = child
    assert pid == real != os.getpid()
    assert in_hook == [real]  # set before the first hook runs
    assert process.STATE.pid == os.getpid()


def test_exit_hooks_run_at_interpreter_exit_and_in_a_process() -> None:
    code = (
        "import multiprocessing as mp, sys\n"
        "from sharedarrays import process\n"
        "def say(what):\n"
        "    def fn():\n"
        "        sys.stdout.write(what + '\\n'); sys.stdout.flush()\n"
        "    fn.__qualname__ = what\n"
        "    return fn\n"
        "process.at_exit(say('memory'), 'memory')\n"
        "process.at_exit(say('transport-only-at-exit'), 'transport', order=1, processes=False)\n"
        "process.at_exit(say('transport'), 'transport')\n"
        "def child():\n"
        "    print('child', flush=True)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('fork').Process(target=child)\n"
        "    p.start(); p.join(30)\n"
        "    print('parent', flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    # the forked Process: its finalizers (no atexit); then the parent: atexit, then
    # multiprocessing's own exit function runs the Process-wide hooks again (idempotent)
    assert lines[:3] == ["child", "transport", "memory"], lines
    assert lines[3:7] == ["parent", "transport", "transport-only-at-exit", "memory"], lines
