"""The docs fit and their links land: the README at most :data:`README_LINES` lines, ``docs/usage.md`` at most
:data:`USAGE_LINES`, every relative Markdown link of the README and ``docs/`` names a file that exists and, with
``#anchor``, one of its headings (GitHub's anchor rule), and every "[Note: X] in FILE" of the code and the docs
names a file that holds that note."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_LINES, USAGE_LINES = 250, 450
LINK = re.compile(r"\]\(([^)\s]+?\.md)?(?:#([\w\-]+))?\)")


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), flags=re.M)}


def broken_links(root: Path) -> list[str]:
    """Every relative link of ``root``'s README and ``docs/*.md`` that lands nowhere, one line each."""
    bad = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for m in LINK.finditer(doc.read_text()):
            target, anchor = m.group(1), m.group(2)
            if target is None and anchor is None or target is not None and "://" in target:
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                bad.append(f"{doc.relative_to(root)}: {m.group(0)} (no file)")
            elif anchor is not None and anchor not in _anchors(path):
                bad.append(f"{doc.relative_to(root)}: {m.group(0)} (no heading)")
    return bad


def _flat(text: str) -> str:
    """Text with line breaks, comment marks and runs of spaces folded, so a note's name may wrap."""
    return re.sub(r"\s+", " ", re.sub(r"\n\s*(#+|\"\"\")?\s*", " ", text))


def note_violations(root: Path) -> list[str]:
    """Every ``[Note: X] in FILE`` whose FILE (a path suffix) holds no ``[Note: X]``, one line each."""
    folders = ("overlap_muon", "hooks", "scheduler", "tests", "docs", "examples")
    files = [root / "README.md"] + [p for f in folders if (root / f).exists() for p in sorted((root / f).rglob("*"))
                                    if p.suffix in (".py", ".md")]
    flat = {p: _flat(p.read_text()) for p in files}
    bad = []
    for p in files:
        for m in re.finditer(r"\[Note: ([^\]]+)\] in `*([\w/.]+\.py)", flat[p]):
            note, target = m.group(1), m.group(2)
            if not any(f"[Note: {note}]" in flat[q] for q in files if str(q).endswith("/" + target)):
                bad.append(f"{p.relative_to(root)}: [Note: {note}] is not in {target}")
    return bad


def size_violations(root: Path) -> list[str]:
    bad = []
    for rel, limit in (("README.md", README_LINES), ("docs/usage.md", USAGE_LINES)):
        n = len((root / rel).read_text().splitlines())
        if n > limit:
            bad.append(f"{rel}: {n} lines (limit {limit}: give the detail a page of its own)")
    return bad


def test_docs_fit_and_links_land():
    assert not size_violations(ROOT), size_violations(ROOT)
    assert not broken_links(ROOT), "\n".join(broken_links(ROOT))
    assert not note_violations(ROOT), "\n".join(note_violations(ROOT))


def test_planted_doc_violations_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# t\n\n[a](docs/a.md#nowhere) [b](docs/none.md) [c](#t)\n" + "x\n" * 260)
    (tmp_path / "docs" / "a.md").write_text("# A page\n")
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n" + "y\n" * 460)
    assert len(broken_links(tmp_path)) == 2, broken_links(tmp_path)
    note = "[" + "Note: "  # not written whole here: this file is scanned too
    (tmp_path / "docs" / "b.md").write_text(f"{note}other name] in `tests/y.py`; {note}gone] in `tests/y.py`\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "y.py").write_text(f"# {note}other\n# name]: a note whose name wraps\n")
    assert [v.split(": ", 1)[1] for v in note_violations(tmp_path)] == [f"{note}gone] is not in tests/y.py"], \
        note_violations(tmp_path)
    assert len(size_violations(tmp_path)) == 2, size_violations(tmp_path)
