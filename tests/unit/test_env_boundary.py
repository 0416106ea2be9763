"""The core reads only its own variables: no module of the product outside adapters/ names a
serving framework's variable (`SGLANG_*`, `VLLM_*`), in code or docstring, read from the source
(ast); each adapter maps its framework's names onto EngineConfig's arguments
(adapters/sglang/plugin.py `engine_options`). And every variable transfer/config.py reads is a
`KVSTAGE_*` one. The checker is tried on small sources first, so a scan that finds nothing cannot
pass for a clean tree."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("SGLANG_", "VLLM_")
# what is not the core: the adapters, and the tests, examples and their support package
OUTSIDE = ("adapters", "tests", "examples", "support")


def framework_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant (docstrings and f-string parts included) that names
    a framework variable."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and any(prefix in node.value for prefix in FRAMEWORKS)]


def core_files(root: Path = ROOT) -> list[Path]:
    """The package's modules at its root and in its subpackages (a folder with an __init__.py;
    not a virtual environment or build output) other than OUTSIDE."""
    packages = [d for d in root.iterdir() if d.is_dir() and (d / "__init__.py").is_file() and d.name not in OUTSIDE]
    return sorted([*root.glob("*.py"), *(p for d in packages for p in d.rglob("*.py"))])


def test_the_checker_finds_a_framework_name_however_it_is_spelled():
    assert framework_names('X = "SGLANG_DISAGG_STAGING_BUFFER"') == [(1, "SGLANG_DISAGG_STAGING_BUFFER")]
    assert framework_names('"""reads SGLANG_X"""\nimport os') == [(1, "reads SGLANG_X")]
    assert framework_names('f = f"{n} VLLM_HOST_IP"') == [(1, " VLLM_HOST_IP")]
    assert framework_names('os.environ.get("KVSTAGE_STAGING")  # not SGLANG_X') == []


def test_no_core_module_names_a_framework_variable():
    files = core_files()
    parts = {p.relative_to(ROOT).parts[0] for p in files}
    assert {"transfer", "staging", "bootstrap", "wire.py"} <= parts and not parts & set(OUTSIDE)
    assert ROOT / "transfer" / "config.py" in files
    found = [f"{p.relative_to(ROOT)}:{line}: {text[:80]!r}" for p in files
             for line, text in framework_names(p.read_text(encoding="utf-8"))]
    assert found == [], "the core names a framework's variable (map it in its adapter):\n" + "\n".join(found)


def test_every_variable_the_configuration_reads_is_kvstages():
    from kvstage.transfer import config

    names = {k: v for k, v in vars(config).items() if k.endswith("_ENV") and isinstance(v, str)}
    assert {"STAGING_ENV", "RING_MB_ENV", "PATH_ENV", "METRICS_PORT_ENV"} <= set(names)
    assert [v for v in names.values() if not v.startswith("KVSTAGE_")] == []
    assert (config.STAGING_ENV, config.RING_MB_ENV) == ("KVSTAGE_STAGING", "KVSTAGE_RING_MB")
