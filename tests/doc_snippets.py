"""The Python blocks of README.md and docs/*.md, and what each is.

Every ```python block in those files is preceded, on the line before its fence, by a marker:
- `<!-- snippet: fragment -->`: a fragment (names left undefined, `...`), read but not run;
- `<!-- snippet: readme-example PART -->`: a part of the README's embedding example, which
  tests/integration/test_readme_example.py runs as it stands (PART: common, prefill, decode).
A block with no marker, or a marker of another kind, is an error (tests/unit/test_doc_snippets.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*snippet:\s*(?P<kind>[\w-]+)(?:\s+(?P<part>[\w-]+))?\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
EXAMPLE_PARTS = ("common", "prefill", "decode")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int            # of the opening fence, counted from 1
    marker: str | None   # the marker line before the fence, as written; None if there is none
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def kind(self) -> tuple[str, str | None] | None:
        """(kind, part) of the marker, None when there is no well-formed marker."""
        m = MARKER.fullmatch(self.marker.strip()) if self.marker is not None else None
        return (m["kind"], m["part"]) if m else None


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_snippets(path: Path) -> list[Snippet]:
    """Every ```python block of `path`, with the non-blank line before its fence."""
    lines = path.read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: a code fence that is never closed")
        if m["lang"] in ("python", "py"):
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), None)
            marker = before if before is not None and before.lstrip().startswith("<!--") else None
            out.append(Snippet(path=path, line=i + 1, marker=marker, code="\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def readme_example() -> dict[str, str]:
    """The README's embedding example: its code by part. Raises ValueError when a part is missing
    or given twice."""
    parts: dict[str, str] = {}
    for snip in python_snippets(ROOT / "README.md"):
        kind = snip.kind()
        if kind is None or kind[0] != "readme-example":
            continue
        if kind[1] not in EXAMPLE_PARTS or kind[1] in parts:
            raise ValueError(f"{snip.where}: readme-example part {kind[1]!r} unknown or given twice")
        parts[kind[1]] = snip.code
    missing = [p for p in EXAMPLE_PARTS if p not in parts]
    if missing:
        raise ValueError(f"README.md: the embedding example lacks its part(s) {missing}")
    return parts
