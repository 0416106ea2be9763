"""States, verdicts, roles and kinds are compared by their enum member, never by the string it
spells (issue "one readable request path": a typo in a string is a comparison that is always
false; a typo in a member name is an AttributeError). Every comparison in the core between a
str literal and something else is checked against the values of the core's str enums."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kvstage
from kvstage.transfer.protocol.kinds import StrKind

ROOT = Path(kvstage.__file__).resolve().parent
CORE = ("transfer/engine", "transfer/protocol", "staging")


def enum_values() -> dict[str, str]:
    """Every value of a str enum defined in the core -> its enum's name."""
    out: dict[str, str] = {}
    for folder in CORE:
        package = "kvstage." + folder.replace("/", ".")
        for mod in pkgutil.walk_packages([str(ROOT / folder)], f"{package}."):   # the role packages too
            module = importlib.import_module(mod.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, StrKind) and cls is not StrKind and cls.__module__ == module.__name__:
                    for member in cls:
                        out.setdefault(member.value, cls.__name__)
    return out


def spelled(tree: ast.AST, values: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, literal, enum) of each comparison of a non-literal with a str literal that is an
    enum value (also inside a tuple or set literal on the right of `in`)."""
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, op, b in zip(operands, node.ops, operands[1:]):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                continue
            for lit, other in ((a, b), (b, a)):
                literals = lit.elts if isinstance(lit, (ast.Tuple, ast.Set, ast.List)) else [lit]
                if isinstance(other, ast.Constant):
                    continue
                for x in literals:
                    if isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value in values:
                        hits.append((node.lineno, x.value, values[x.value]))
    return hits


def core_files() -> list[Path]:
    return sorted(p for folder in CORE for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_enum_values_are_not_spelled(path):
    hits = spelled(ast.parse(path.read_text()), enum_values())
    assert not hits, "\n".join(f"{path.relative_to(ROOT)}:{line}: {lit!r} spelled; use {enum}" for line, lit, enum in hits)


def test_the_check_finds_a_spelled_state():
    tree = ast.parse('if peer.state == "connected" or verdict in ("ok", "x") or kind != FailureKind.CORRUPT:\n    pass')
    values = {"connected": "PeerState", "ok": "TagVerdict", "corrupt": "FailureKind"}
    assert [(lit, enum) for _, lit, enum in spelled(tree, values)] == [("connected", "PeerState"), ("ok", "TagVerdict")]
