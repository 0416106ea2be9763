"""Every Python block in README.md and docs/*.md says what it is (tests/doc_snippets.py): part of
the README's example, which tests/integration/test_readme_example.py runs, or a fragment. A
fragment is not run, but it parses, and what it imports from kvstage exists: a renamed or
moved public name fails here instead of in a reader's first try."""

from __future__ import annotations

import ast
import importlib

import pytest
from doc_snippets import EXAMPLE_PARTS, Snippet, documents, python_snippets, readme_example

SNIPPETS = [s for doc in documents() for s in python_snippets(doc)]


def _id(s: Snippet) -> str:
    return s.where


def test_the_documents_have_python_blocks():
    assert len(SNIPPETS) >= 1 + len(EXAMPLE_PARTS)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=_id)
def test_each_block_is_marked(snippet: Snippet):
    kind = snippet.kind()
    assert kind is not None, (f"{snippet.where}: a ```python block needs a marker on the line before it: "
                              f"<!-- snippet: fragment --> (see tests/doc_snippets.py)")
    if kind[0] == "readme-example":
        assert snippet.path.name == "README.md" and kind[1] in EXAMPLE_PARTS, snippet.where
    else:
        assert kind == ("fragment", None), f"{snippet.where}: unknown marker {snippet.marker!r}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=_id)
def test_each_block_parses_and_its_kvstage_imports_exist(snippet: Snippet):
    try:
        tree = ast.parse(snippet.code)
    except SyntaxError as exc:
        pytest.fail(f"{snippet.where}: does not parse: {exc}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvstage":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or _is_module(f"{node.module}.{alias.name}"), (
                    f"{snippet.where}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvstage":
                    importlib.import_module(alias.name)


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def test_the_readme_example_has_its_three_parts():
    parts = readme_example()
    assert set(parts) == set(EXAMPLE_PARTS)
    assert "start_rank" in parts["common"] and "sender" in parts["prefill"] and "receiver" in parts["decode"]


def test_an_unmarked_block_is_found(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```python\nx = 1\n```\n\n<!-- snippet: fragment -->\n```python\ny = 2\n```\n")
    found = python_snippets(doc)
    assert [(s.line, s.marker) for s in found] == [(3, None), (8, "<!-- snippet: fragment -->")]
    assert found[1].code == "y = 2\n"
