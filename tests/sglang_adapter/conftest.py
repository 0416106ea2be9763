"""The SGLang adapter's tests run in the SGLang venv (`make test-sglang`); elsewhere (the main
venv of `make test`) SGLang is not installed, and this folder is not collected at all. Asked of
the installed distributions: a directory named like the package could pass for it on sys.path."""

from importlib import metadata

try:
    metadata.version("sglang")
    collect_ignore_glob: list[str] = []
except metadata.PackageNotFoundError:
    collect_ignore_glob = ["*"]


MOONCAKE_CUDA = "mooncake-transfer-engine-cuda13"

if not collect_ignore_glob:
    import json
    import os
    import time
    from pathlib import Path

    import torch

    # The CUDA versions of the scheduler-class tests (test_cuda_*.py, KV caches on GPU 0) are
    # collected only where torch sees a CUDA device, as tests/gpu; elsewhere they are not
    # collected at all rather than skipped (a skip would read as a check that was made). The
    # Mooncake one also needs Mooncake's CUDA build, the one that registers VRAM.
    if not torch.cuda.is_available():
        collect_ignore_glob = ["test_cuda_*.py"]
    else:
        try:
            metadata.version(MOONCAKE_CUDA)
        except metadata.PackageNotFoundError:
            collect_ignore_glob = ["test_cuda_mooncake*.py"]

    # read at import time by huggingface_hub: the rank launcher's forkserver imports it once for
    # every rank (rank_launcher.py), so it is set before the first launch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import pytest

    from kvstage.support.cluster import free_port

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> str:
        """SGLang's ServerArgs reads a model config; the harness never loads weights."""
        d = tmp_path_factory.mktemp("model")
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}))
        return str(d)

    @pytest.fixture(scope="module")
    def model_3_layers(model_dir, tmp_path_factory) -> str:
        """The same model with 3 layers: SGLang's `get_pp_indices` splits it 1 + 2 over 2 PP stages
        (test_pp_prefill_classes.py, test_pp_decode_classes.py)."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        d = tmp_path_factory.mktemp("model3")
        (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
        return str(d)

    @pytest.fixture(scope="module")
    def mla_model_dir(tmp_path_factory) -> str:
        """A DeepSeek V3 config of 2 layers: a model SGLang takes as MLA (its KV cache sharding
        resolves for plain-TP MLA only; test_kv_shard_classes.py)."""
        d = tmp_path_factory.mktemp("mla-model")
        (d / "config.json").write_text(json.dumps({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
            "torch_dtype": "bfloat16", "kv_lora_rank": 4, "q_lora_rank": None, "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "first_k_dense_replace": 2, "n_shared_experts": 1, "bos_token_id": 1, "eos_token_id": 2}))
        return str(d)

    @pytest.fixture
    def bootstrap_server():
        """The prefill instance's SGLang bootstrap server, as SGLang's launcher starts it: the class
        comes from get_kv_class for backend kvstage (it also runs kvstage's rendezvous server)."""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import requests
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        port = free_port()
        server = get_kv_class(TransferBackend("kvstage"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "the SGLang bootstrap server never answered /health"
            time.sleep(0.1)
        yield port
        server.close()
