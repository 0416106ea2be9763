"""No two test files that one `make test` run collects share a name: the test folders have no
__init__.py, so pytest imports each file as a top-level module by its name, and a second file of
the same name stops the whole run at collection ("import file mismatch"). The adapters' folders
run in their own venvs (make test-sglang, make test-vllm) and are left out."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
OWN_RUNS = {"sglang_adapter", "vllm_adapter"}


def clashing_names(root: Path) -> dict[str, list[str]]:
    """Test file names found in more than one folder of `root` that make test collects."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in root.rglob("test_*.py"):
        if OWN_RUNS.intersection(path.relative_to(root).parts):
            continue
        seen[path.name].append(str(path.parent.relative_to(root)))
    return {name: dirs for name, dirs in seen.items() if len(dirs) > 1}


def test_no_two_test_files_share_a_name():
    assert clashing_names(TESTS) == {}
