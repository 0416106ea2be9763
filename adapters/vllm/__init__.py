"""kvstage as a vLLM v1 KV connector (push from prefill to decode, staged for heterogeneous TP).

Loaded by vLLM without patching: ``--kv-transfer-config '{"kv_connector": "KvstageConnector",
"kv_connector_module_path": "kvstage.adapters.vllm.connector", ...}'``. Nothing here imports vLLM
until vLLM imports `connector`. See docs/vllm.md.
"""

from __future__ import annotations

CONNECTOR = "KvstageConnector"
MODULE = "kvstage.adapters.vllm.connector"
