"""The tests and the examples meet only in kvstage.support (support/), read from the source (ast):

- no file of examples/ imports a module of tests/, and no test imports a module of examples/ as
  a library (a test may run an example as a process); neither loads the other by file path
  (importlib's spec_from_file_location, runpy.run_path);
- no file of examples/ edits sys.path to reach into tests/, and no test into examples/;
- support/ imports neither side;
- nothing of the product (every module of the package outside support/, tests/, examples/)
  imports kvstage.support (lint's import-linter contract says the same for the named parts).

A sys.path edit is read as text, with the module-level names it uses replaced by what they were
assigned (`EXAMPLES = ROOT / "examples"`; `sys.path.insert(0, str(EXAMPLES))` points into
examples/). The checker itself is tried on small sources below, so a scan that finds nothing
cannot pass for a clean tree."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# tests/sglang_adapter's shims stand in for third-party distributions (sgl_kernel, torchvision,
# a Mooncake package): they are put on the SGLang servers' PYTHONPATH, never imported by name
SHIM_DIRS = ("shims", "mooncake_cpu_shim")
LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader"}
PATH_EDITS = {"insert", "append", "extend"}


@dataclass(frozen=True)
class Side:
    """One side of the line: its folder (as sys.path edits and file loads name it) and the
    top-level names its modules import as."""

    folder: str
    modules: frozenset[str]


def _py_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if not set(p.relative_to(folder).parts) & set(SHIM_DIRS))


def side_of_examples(root: Path = ROOT) -> Side:
    return Side("examples", frozenset(p.stem for p in (root / "examples").glob("*.py")))


def side_of_tests(root: Path = ROOT) -> Side:
    names = {p.stem for p in _py_files(root / "tests")} - {"conftest"}
    return Side("tests", frozenset(names))


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every absolute import, at any depth (lazy ones too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _assignments(tree: ast.Module) -> dict[str, ast.AST]:
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def _expanded(node: ast.AST, source: str, names: dict[str, ast.AST]) -> str:
    """The source of `node` followed by what each module-level name in it was assigned, and so
    on for the names in those (EXAMPLES = HERE / "examples"), each name once."""
    parts, todo, seen = [], [ast.get_source_segment(source, node) or ""], set()
    while todo:
        text = todo.pop()
        parts.append(text)
        for name in set(re.findall(r"\b[A-Za-z_]\w*\b", text)) - seen:
            seen.add(name)
            if name in names:
                todo.append(ast.get_source_segment(source, names[name]) or "")
    return " ".join(parts)


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _reaches(text: str, folder: str) -> bool:
    return re.search(rf"\b{folder}\b", text, re.IGNORECASE) is not None


def crossings(source: str, where: str, *others: Side) -> list[str]:
    """What `source` (a file at `where`) does to reach any of `others`: imports of its modules,
    loads of its files, sys.path edits pointing into its folder."""
    tree = ast.parse(source)
    return [found for other in others for found in _crossings(tree, source, where, other)]


def _crossings(tree: ast.Module, source: str, where: str, other: Side) -> list[str]:
    names = _assignments(tree)
    found = [f"{where}:{line}: imports {name} ({other.folder}/)"
             for line, name in _imported(tree)
             if name.split(".")[0] in other.modules or name.split(".")[0] == other.folder]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in PATH_EDITS and _is_sys_path(f.value):
                if any(_reaches(_expanded(a, source, names), other.folder) for a in node.args):
                    found.append(f"{where}:{node.lineno}: sys.path.{f.attr} into {other.folder}/")
        if isinstance(node, ast.Call):
            fname = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fname in LOADERS and any(_reaches(_expanded(a, source, names), other.folder) for a in node.args):
                found.append(f"{where}:{node.lineno}: {fname} of a file in {other.folder}/")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_sys_path(t) for t in targets) and _reaches(_expanded(node.value, source, names), other.folder):
                found.append(f"{where}:{node.lineno}: sys.path set into {other.folder}/")
    return found


def support_imports(source: str, where: str, package: str) -> list[str]:
    """Imports of kvstage.support in a product module `package`.`<where's stem>`, absolute or
    relative (`from ..support import x` in kvstage.transfer.foo)."""
    tree = ast.parse(source)
    found = [f"{where}:{line}: imports {name}" for line, name in _imported(tree)
             if name == "kvstage.support" or name.startswith("kvstage.support.")]
    parts = package.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = parts[: len(parts) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            mods = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            if any(m == "kvstage.support" or m.startswith("kvstage.support.") for m in mods):
                found.append(f"{where}:{node.lineno}: imports {mods[0]} (relative)")
    return found


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_the_checker_sees_each_kind_of_crossing():
    ex = Side("examples", frozenset({"pd_rank", "bench"}))
    ts = Side("tests", frozenset({"servers", "engine_cases"}))
    assert crossings("import pd_rank\n", "t.py", ex) == ["t.py:1: imports pd_rank (examples/)"]
    assert crossings("def f():\n    from bench import parse\n", "t.py", ex) == ["t.py:2: imports bench (examples/)"]
    assert crossings("from servers import Proc\n", "e.py", ts) == ["e.py:1: imports servers (tests/)"]
    assert crossings("import sys\nsys.path.insert(0, str(ROOT / 'tests' / 'vllm_adapter'))\n", "e.py", ts)
    assert crossings("import sys\nfrom pathlib import Path\nEX = Path(__file__).parents[2] / 'examples'\n"
                     "sys.path.insert(0, str(EX))\n", "t.py", ex)
    assert crossings("import sys\nsys.path = ['examples'] + sys.path\n", "t.py", ex)
    assert crossings("import importlib.util\nspec = importlib.util.spec_from_file_location('b', ROOT / 'examples'"
                     " / 'b.py')\n", "t.py", ex)
    # on the right side of the line: the support package, a script run as a process, own folders
    assert crossings("from kvstage.support import bench\nfrom kvstage.support.cluster import Cluster\n"
                     "import subprocess, sys\nsubprocess.run([sys.executable, 'examples/bench.py'])\n"
                     "sys.path.insert(0, str(Path(__file__).parent / 'integration'))\n", "t.py", ex) == []
    assert support_imports("from ..support import cluster\n", "transfer/x.py", "kvstage.transfer") == [
        "transfer/x.py:1: imports kvstage.support (relative)"]
    assert support_imports("from kvstage.support.cluster import free_port\n", "x.py", "kvstage")
    assert support_imports("from . import layout\nfrom kvstage.transfer import KVPoll\n", "x.py", "kvstage.transfer") == []


def test_examples_and_tests_meet_only_in_support():
    ex, ts = side_of_examples(), side_of_tests()
    assert {"pd_rank", "pd_demo", "bench"} <= ex.modules and {"engine_cases", "records"} <= ts.modules
    found = []
    for p in _py_files(ROOT / "tests"):
        found += crossings(p.read_text(), _rel(p), ex)
    for p in _py_files(ROOT / "examples"):
        found += crossings(p.read_text(), _rel(p), ts)
    for p in _py_files(ROOT / "support"):
        found += crossings(p.read_text(), _rel(p), ex, ts)
    assert found == [], "\n".join(found)


def test_the_product_never_imports_support():
    skip = {"tests", "examples", "support", "build", "docs"}
    checked, found = 0, []
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT).parts
        if parts[0] in skip or parts[0].startswith("."):
            continue
        package = ".".join(("kvstage",) + parts[:-1])
        found += support_imports(p.read_text(), _rel(p), package)
        checked += 1
    assert checked > 50 and found == [], "\n".join(found)
