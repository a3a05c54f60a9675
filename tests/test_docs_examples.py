"""Every Python example of README.md, docs/*.md and docs/guide/*.md runs as it is, on the
host backend.

Which blocks run, and how (the convention the docs follow):

- every fenced block marked ``python``, ``py`` or ``pycon`` runs, alone, in a fresh
  interpreter, from a file (``python example.py`` in an empty directory), as a user who
  copies it into a script runs it: a block that starts processes keeps its work under
  ``if __name__ == "__main__":``, as a script must;
- a block whose preceding line is ``<!-- not run: REASON -->`` is not run (it needs a GPU,
  a cluster, Ray, or is a fragment of a worker's code); its test is skipped with REASON;
- a block whose preceding line is ``<!-- run as a notebook cell -->`` runs with
  ``python -c``: as in a notebook, ``__main__`` has no file, so spawned workers do not import
  it again and a function it defines travels by value (``sa.Pool``);
- a line ``print(...)  # TEXT`` says what the example prints: the lines of TEXT must be lines
  of its output, in that order.

Each example runs with ``CUDA_VISIBLE_DEVICES=""`` (so ``device=None`` is the host), in a
private runtime directory (its own keeper), with a time limit after which the example and
every process it started are killed. A ``>>>`` session is a ``pycon`` block like any other:
it fails unless marked, since a file of prompts is no script.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from keeper_helpers import private_keeper  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guide").glob("*.md")),
]
TIMEOUT = 120.0  # seconds an example may take (each takes 1 to 6 s on two cores)

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^\s`]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<why>.+?)\s*-->\s*$")
NOTEBOOK_CELL = re.compile(r"^\s*<!--\s*run as a notebook cell\s*-->\s*$")
PRINTS = re.compile(r"^\s*print\(.*\)\s*#\s*(?P<out>.+?)\s*$")
PYTHON = {"python", "py", "pycon"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where it starts, its language, its code
    (dedented by the fence's indentation) and the marker on the line before it."""

    page: str
    line: int
    lang: str
    code: str
    marker: str

    @property
    def not_run(self) -> str | None:
        """The reason given by ``<!-- not run: REASON -->``, or None."""
        match = NOT_RUN.match(self.marker)
        return match.group("why") if match else None

    @property
    def notebook_cell(self) -> bool:
        return NOTEBOOK_CELL.match(self.marker) is not None

    @property
    def printed(self) -> list[str]:
        """What the block's ``print(...)  # TEXT`` lines say it prints, in order."""
        return [m.group("out") for m in map(PRINTS.match, self.code.splitlines()) if m]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    lines = page.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None or not fence.group("lang"):
            i += 1
            continue
        indent = len(fence.group("indent"))
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{i + 1}: a code block that never ends")
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        marker = lines[i - 1] if i > 0 else ""
        where = page.relative_to(ROOT).as_posix()
        found.append(Block(where, i + 1, fence.group("lang"), code, marker))
        i = end + 1
    return found


EXAMPLES = [block for page in PAGES for block in blocks(page) if block.lang in PYTHON]


def test_the_examples_are_found() -> None:
    """The extraction sees the examples the pages have (a broken pattern would find none,
    and every example test would then pass by not existing)."""
    where = {(block.page, block.code.splitlines()[0]) for block in EXAMPLES}
    assert ("README.md", "import multiprocessing, pickle") in where
    assert ("docs/guide/sharing.md", "import multiprocessing as mp") in where
    assert sum(block.not_run is None for block in EXAMPLES) >= 20
    assert any(block.notebook_cell for block in EXAMPLES)
    skipped = [block for block in EXAMPLES if block.not_run]
    assert skipped and all(block.not_run for block in skipped)


def test_markers_sit_right_before_a_block() -> None:
    """A marker on any other line would silently mark nothing."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line) or NOTEBOOK_CELL.match(line):
                following = lines[i + 1] if i + 1 < len(lines) else ""
                fence = FENCE.match(following)
                assert fence is not None and fence.group("lang") in PYTHON | {"sh", "bash"}, (
                    f"{page}:{i + 1}: a marker not followed by a code block"
                )


def test_printed_comments_are_read() -> None:
    block = Block("x.md", 1, "python", 'x = 1\nprint(x)   # 1\nprint("a b")  # a b\n', "")
    assert block.printed == ["1", "a b"]


def _run(block: Block, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run ``block`` in ``directory`` (a file, or ``python -c`` for a notebook cell); past
    TIMEOUT its whole process group is killed and the test fails."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if block.notebook_cell:
        argv = [sys.executable, "-c", block.code]
    else:
        (directory / "example.py").write_text(block.code)
        argv = [sys.executable, "example.py"]
    proc = subprocess.Popen(
        argv,
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too are killed on a timeout
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{block.page}:{block.line} did not finish within {TIMEOUT:.0f} s\n"
            f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (a worker left behind)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("block", EXAMPLES, ids=[f"{b.page}:{b.line}" for b in EXAMPLES])
def test_example_runs_as_written(
    block: Block,
    tmp_path: Path,
    private_keeper: Path,  # noqa: F811 - its own keeper: names made here go with it
) -> None:
    if block.not_run is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.not_run}")
    done = _run(block, tmp_path)
    assert done.returncode == 0, (
        f"{block.page}:{block.line} exited with {done.returncode}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    )
    # (a script's stderr gets no progress bar unasked, and its exit no resource tracker
    # warning: a bar in a pool worker left "leaked semaphore objects" behind)
    for unwanted in ("%|", "resource_tracker"):
        assert unwanted not in done.stderr, (
            f"{block.page}:{block.line} wrote {unwanted!r} to stderr:\n{done.stderr[-4000:]}"
        )
    lines = iter(line.strip() for line in done.stdout.splitlines())
    for expected in block.printed:
        assert any(line == expected for line in lines), (
            f"{block.page}:{block.line} should print {expected!r} (in this order); "
            f"it printed:\n{done.stdout}"
        )
