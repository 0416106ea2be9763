"""Every stats key the engine and staging bump is declared in transfer/engine/stats.py (`Number`
or `Group`), with the method that fits its kind, and every declared key is bumped somewhere:
read from the source, so a misspelt key fails here rather than becoming a new counter."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstage
from kvstage.transfer.engine.stats import GROUPS, NUMBERS

ROOT = Path(kvstage.__file__).resolve().parent
NUMBER_METHODS, GROUP_METHODS = {"add", "maximum", "set"}, {"count", "sum_in"}


def stats_calls(tree: ast.AST) -> list[tuple[int, str, object]]:
    """(line, method, first argument: the str, or the expression's text) of each call of a
    Stats method on something named `...stats`."""
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in NUMBER_METHODS | GROUP_METHODS):
            continue
        owner = n.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
        if not name.endswith("stats"):
            continue
        first = n.args[0] if n.args else None
        key = first.value if isinstance(first, ast.Constant) else ast.unparse(first) if first is not None else None
        out.append((n.lineno, n.func.attr, key if isinstance(first, ast.Constant) else ("expr", key)))
    return out


def problems(tree: ast.AST, where: str) -> tuple[list[str], set[str]]:
    bad, used = [], set()
    for line, method, key in stats_calls(tree):
        if not isinstance(key, str):
            bad.append(f"{where}:{line}: stats.{method}() with a computed key {key[1]!r}: name it")
            continue
        used.add(key)
        declared = NUMBERS if method in NUMBER_METHODS else GROUPS
        if key not in declared:
            kind = "Number" if method in NUMBER_METHODS else "Group"
            bad.append(f"{where}:{line}: stats.{method}({key!r}): not a declared {kind} (transfer/engine/stats.py)")
    return bad, used


def test_every_key_bumped_is_declared_and_every_declared_key_is_bumped():
    bad, used = [], set()
    for folder in ("transfer", "staging"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            b, u = problems(ast.parse(path.read_text()), str(path.relative_to(ROOT)))
            bad += b
            used |= u
    assert not bad, "\n".join(bad)
    assert (NUMBERS | GROUPS) - used == set(), "declared but never bumped"


def test_a_misspelt_key_is_caught():
    tree = ast.parse('ctx.stats.add("bytes_postd")\nself.stats.count("rooms", "x")\nstats.count(name, "y")')
    bad, used = problems(tree, "t.py")
    assert len(bad) == 2 and "bytes_postd" in bad[0] and "computed key 'name'" in bad[1] and used == {"bytes_postd",
                                                                                                     "rooms"}
