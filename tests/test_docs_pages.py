"""The shape of the docs a new user reads first: user guide pages short enough to read, in
short paragraphs; every link between the pages (README.md, docs/, notebooks/) reaches a
page and a heading that exist; the README's lifetime rules and two set-up commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDE = sorted((DOCS / "guide").glob("*.md"))
MAX_LINES = 400  # lines of one user guide page
MAX_PARAGRAPH = 12  # lines of one paragraph or list item

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
ITEM = re.compile(r"^\s*([-*]|\d+\.|:)\s")


def prose(text: str) -> list[tuple[int, int]]:
    """``(first line, lines)`` of each paragraph and list item outside code blocks, tables
    and headings."""
    found: list[tuple[int, int]] = []
    start, count, fence = 0, 0, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        boundary = (
            stripped.startswith("```")
            or fence
            or not stripped
            or stripped.startswith(("|", "#", "<!--"))
            or ITEM.match(line) is not None
        )
        if boundary and count:
            found.append((start, count))
            count = 0
        if stripped.startswith("```"):
            fence = not fence
            continue
        if fence or not stripped or stripped.startswith(("|", "#", "<!--")):
            continue
        if count == 0:
            start = number
        count += 1
    if count:
        found.append((start, count))
    return found


def test_prose_splits_paragraphs_and_items() -> None:
    text = "a\nb\n\n- c\n  d\n- e\n\n```python\nx\ny\n```\n| t |\n"
    assert prose(text) == [(1, 2), (4, 2), (6, 1)]


def test_the_user_guide_is_pages_of_short_paragraphs() -> None:
    assert len(GUIDE) >= 5, "the user guide is split into pages under docs/guide/"
    for page in [*GUIDE, DOCS / "user-guide.md"]:
        text = page.read_text()
        lines = len(text.splitlines())
        assert lines <= MAX_LINES, f"{page.relative_to(ROOT)} has {lines} lines"
        for start, count in prose(text):
            assert count <= MAX_PARAGRAPH, (
                f"{page.relative_to(ROOT)}:{start}: a paragraph of {count} lines"
            )


def slug(heading: str) -> str:
    """The anchor of a Markdown heading, as GitHub and MyST make it."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code blocks)."""
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.strip().startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def markdown_texts() -> list[tuple[Path, str]]:
    """README.md, every docs page and every notebook's Markdown cells."""
    pages = [ROOT / "README.md", *DOCS.glob("*.md"), *GUIDE]
    texts = [(page, page.read_text()) for page in pages]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        texts.append((notebook, "\n".join(markdown)))
    return texts


@pytest.mark.parametrize(("page", "text"), markdown_texts(), ids=lambda v: str(v)[-40:])
def test_local_links_reach_a_page_and_a_heading(page: Path, text: str) -> None:
    for match in LINK.finditer(text):
        target = match.group("target")
        if re.match(r"^[a-z]+:", target):  # (https:, mailto:)
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.relative_to(ROOT)}: {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.relative_to(ROOT)}: {target}: no heading"


def test_readme_lists_the_lifetime_rules_next_to_the_quick_start() -> None:
    text = (ROOT / "README.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    titles = [section.splitlines()[0] for section in sections[1:]]
    assert titles[0] == "Quick start" and "ifetime" in titles[1], titles
    rules = sections[2]
    for rule in ("SHAREDARRAYS_IN_FLIGHT", "len(pickle.dumps(a))", "unlink", "readonly=True"):
        assert rule in rules, rule
    assert "advanced indexing" in rules and "copy" in rules


def test_readme_has_two_set_up_commands() -> None:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(make \S+)", text, flags=re.M)
    assert commands == ["make demo", "make test"], commands
