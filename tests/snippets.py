"""The code blocks of the docs, for the tests that run them verbatim (so that the docs and the tests cannot drift)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doc_snippet(path: str, heading: str, index: int = 0) -> str:
    """The ``index``-th fenced ``python`` block under the Markdown heading ``heading`` of ``path`` (from the repository
    root), up to the next heading of the same or a higher level.

    Raises:
        LookupError: no such heading or block.
    """
    text = (ROOT / path).read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, flags=re.M)
    if m is None:
        raise LookupError(f"{path}: no heading {heading!r}")
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, flags=re.M)
    blocks = re.findall(r"^```python\n(.*?)^```", rest[: end.start() if end else None], flags=re.M | re.S)
    if len(blocks) <= index:
        raise LookupError(f"{path}, {heading!r}: {len(blocks)} python blocks, wanted #{index}")
    return blocks[index]
