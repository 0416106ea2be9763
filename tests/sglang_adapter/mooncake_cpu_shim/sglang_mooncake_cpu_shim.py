"""Test-only SGLang plugin: SGLang's own mooncake backend on a CPU-only machine (benchmark).

SGLang's prefill hands a mooncake sender its page indices through pinned host memory and a
torch.cuda.Event when the sender says `supports_host_tensor_indices` (MooncakeKVSender does);
without CUDA both fail. This plugin, found by SGLang's plugin loader through the dist-info
folder beside it (entry point group `sglang.srt.plugins`) only when this folder is on PYTHONPATH,
adds an AFTER hook to MooncakeKVSender.__init__ that turns the flag off for each sender, so the
prefill passes plain CPU indices as it does for every other backend. Nothing else changes.
"""

TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__"


def no_host_tensor_indices(result, sender, *args, **kwargs):
    sender.supports_host_tensor_indices = False


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(TARGET, no_host_tensor_indices, HookType.AFTER)
