"""The docs check (issue 51): links resolve, and every figure in docs/results.md names its data.

- Every relative link and image in README.md and docs/**/*.md points at a file that exists; a
  link with an anchor into a Markdown file (or within the same file) points at a heading that
  exists there, with the heading's anchor derived as GitHub derives it.
- docs/results.md is made of figure tables in the format its first section documents: every
  table has the columns date, commit, machine, command and data, no cell of those is empty,
  and every row's data cell links at least one file under docs/bench/ that exists.

Pure text parsing, no imports of kvstage: it runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
FIGURE_COLUMNS = ("date", "commit", "machine", "command", "data")

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: the text of its inline markup, lower case, every
    character that is not a letter, a digit, a space, '-' or '_' dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    parts = text.split("`")                                         # odd parts: code spans
    text = "".join(p if i % 2 else re.sub(r"<[^>]+>", "", p) for i, p in enumerate(parts)).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `path` that does not resolve, as 'file:line: target (why)'."""
    bad = []
    for no, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor in {dest.name})")
    return bad


def table_rows(text: str) -> list[tuple[int, list[str], list[str]]]:
    """Every body row of every table, as (line number, header cells, row cells)."""
    rows, header = [], None
    lines = prose_lines(text)
    for i, (no, line) in enumerate(lines):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            nxt = lines[i + 1][1] if i + 1 < len(lines) else ""
            if re.match(r"^\s*\|?\s*:?-{3,}", nxt):
                header = [c.lower() for c in cells]
            continue
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue
        rows.append((no, header, cells))
    return rows


def figure_row_problems(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    rows = table_rows(path.read_text(encoding="utf-8"))
    if not rows:
        return [f"{path.name}: no figure table found"]
    for no, header, cells in rows:
        where = f"{path.name}:{no}"
        missing = [c for c in FIGURE_COLUMNS if c not in header]
        if missing:
            problems.append(f"{where}: the table has no column {missing}")
            continue
        if len(cells) != len(header):
            problems.append(f"{where}: {len(cells)} cells under {len(header)} headers")
            continue
        row = dict(zip(header, cells))
        problems += [f"{where}: empty {c}" for c in FIGURE_COLUMNS if not row[c]]
        files = [t.partition("#")[0] for t in _LINK.findall(row["data"])]
        if not files:
            problems.append(f"{where}: the data cell links no file")
        for f in files:
            dest = (path.parent / f).resolve()
            if not dest.is_relative_to(root / "docs" / "bench"):
                problems.append(f"{where}: data file {f} is not under docs/bench/")
            elif not dest.is_file():
                problems.append(f"{where}: data file {f} does not exist")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_every_figure_row_names_an_existing_data_file() -> None:
    assert figure_row_problems(RESULTS) == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    assert github_anchor("Staged vs raw over NIXL shared memory (0.14–0.24×, target 0.35×)") == \
        "staged-vs-raw-over-nixl-shared-memory-014024-target-035"
    assert github_anchor("The GPU path: `make gpu-check`") == "the-gpu-path-make-gpu-check"
    assert github_anchor("Deadlines (env `KVSTAGE_<NAME>`, <em>e.g.</em>)") == "deadlines-env-kvstage_name-eg"
    docs = tmp_path / "docs"
    (docs / "bench").mkdir(parents=True)
    (docs / "bench" / "run.txt").write_text("figures\n")
    (docs / "results.md").write_text("# Results\n## Throughput\n")
    page = docs / "page.md"
    page.write_text("# Probe\n## Twice\n## Twice\n[ok](#twice-1) [ok](results.md#throughput) `[skip](nowhere.md)`\n"
                    "[bad](nowhere.md) [bad](#twice-2) [bad](results.md#no-such-heading)\n"
                    "```\n[skip](nowhere.md)\n```\n"
                    "| x | date | commit | machine | command | data |\n|---|---|---|---|---|---|\n"
                    "| 0 | d | c | m | `cmd` | [run](bench/run.txt) |\n"
                    "| 1 | d | c | m | `cmd` | [a](bench/no-such-file.txt) |\n"
                    "| 2 | d | c | m | `cmd` | none |\n"
                    "| 3 | d | | m | `cmd` | [a](results.md) |\n", encoding="utf-8")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "nowhere.md (no such file)", "#twice-2 (no heading with that anchor in page.md)",
        "results.md#no-such-heading (no heading with that anchor in results.md)",
        "bench/no-such-file.txt (no such file)"]
    problems = figure_row_problems(page, tmp_path)
    assert len(problems) == 4, problems
    assert "does not exist" in problems[0] and "links no file" in problems[1]
    assert "empty commit" in problems[2] and "not under docs/bench/" in problems[3]
