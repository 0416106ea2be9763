"""The SGLang adapter's tests run in the SGLang venv (`make test-sglang`); elsewhere (the main
venv of `make test`) SGLang is not installed, and this folder is not collected at all. Asked of
the installed distributions: a directory named like the package could pass for it on sys.path."""

from importlib import metadata

try:
    metadata.version("sglang")
    collect_ignore_glob: list[str] = []
except metadata.PackageNotFoundError:
    collect_ignore_glob = ["*"]
