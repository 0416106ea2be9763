"""kvstage as an SGLang transfer backend: ``--disaggregation-transfer-backend kvstage``.

Installed with kvstage as an SGLang general plugin (entry point group ``sglang.srt.plugins``);
SGLang calls `register` in every process before it parses arguments. Nothing here imports
SGLang until then, so kvstage itself works without SGLang installed. See docs/sglang.md.
"""

from __future__ import annotations

BACKEND = "kvstage"


def register() -> None:
    """The plugin entry point: add the backend choice and route get_kv_class to kvstage."""
    from .plugin import install
    install()
