"""Everything beside K and V that a request carries: SGLang's aux rows and its state.

Isolated here because it rests on kvstage's state pools (issue 17). The aux buffers (SGLang's
MetadataBuffers: output ids, cached tokens, logprobs, hidden states, bootstrap_room, ...) become
ONE replicated pool named "aux", one tensor per buffer seen as bytes [rows, row bytes]. A request
names its row with `pool_items={"aux": [row]}` on each side (the rows differ), so the row moves
with the request's last chunk, in the writes the KV makes anyway, and is in place before kvstage
reports Success.

The state components (Mamba slots, SWA windows, DSA indexer pages) are more pools, built by
state.py; a request's state_indices become its items of them, on each side.
"""

from __future__ import annotations

import os

import torch

from kvstage import KVBuffers, StatePool
from kvstage.transfer.raw_memory import tensor_at

AUX = "aux"


def host_kv_args(args):
    """KVArgs' host KV buffers (SGLang's host pool for host KV destinations) in the place of its
    device KV buffers: the same layout, other memory; everything else as KVArgs has it."""
    from types import SimpleNamespace
    fields = {k: getattr(args, k) for k in ("aux_data_ptrs", "aux_data_lens", "aux_item_lens") if hasattr(args, k)}
    n = len(args.kv_data_ptrs)
    host = (list(args.host_kv_data_ptrs), list(args.host_kv_data_lens or ()), list(args.host_kv_item_lens or ()))
    if any(len(x) != n for x in host) or host[2] != list(args.kv_item_lens):
        raise ValueError(f"host KV buffers ({len(host[0])} pointers, item sizes {sorted(set(host[2]))}) do not have "
                         f"the device KV's layout ({n} buffers, item sizes {sorted(set(args.kv_item_lens))})")
    return SimpleNamespace(kv_data_ptrs=host[0], kv_data_lens=host[1], kv_item_lens=host[2], **fields)


def has_aux(args) -> bool:
    return bool(getattr(args, "aux_data_ptrs", None))


def make_buffers(layout, args, device: str, state_pools: dict) -> KVBuffers:
    """kvstage buffers over SGLang's memory: KV by pointer (the target's entries, then a draft
    model's: draft_k/draft_v), the aux rows and the state components (`state_pools`, from
    state.StateMap) as state pools."""
    kv = KVBuffers.from_pointers(layout, list(args.kv_data_ptrs), list(args.kv_data_lens),
                                 list(args.kv_item_lens), device=device)
    found = dict(state_pools)
    if has_aux(args):
        dev = aux_device(torch.device(device))
        rows = [tensor_at(ptr, nbytes, torch.uint8, (nbytes // item, item), dev)
                for ptr, nbytes, item in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
        found[AUX] = StatePool(tensors=rows, sharding="replicated")
    if not found:
        return kv
    return KVBuffers(kv.k, kv.v, draft_k=kv.draft_k, draft_v=kv.draft_v, pools=found).validate(layout)


def aux_device(kv_device: torch.device) -> torch.device:
    """Where SGLang keeps its MetadataBuffers: host memory (also beside a CUDA KV cache, on NVIDIA
    GPUs), unless SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK puts them on the GPU. The aux
    pool is then a region of its own kind (transfer/regions.py): a DRAM pool beside a VRAM cache."""
    if kv_device.type == "cuda" and os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "") == "INTRA_NODE_NVLINK":
        return kv_device
    return torch.device("cpu")


def aux_room_column(args, device: str = "cpu") -> torch.Tensor | None:
    """A view of the aux buffer that holds each row's bootstrap_room (SGLang puts it after the
    output buffers, before the optional KV checksum: it is the int64 buffer of 8 columns that
    comes last or last but one)."""
    ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
    if not ptrs:
        return None
    try:
        from sglang.srt.runtime_context import get_disagg
        checksum = bool(get_disagg().disaggregation_enable_kv_checksum)
    except Exception:  # noqa: BLE001 - harnesses without a published config
        checksum = False
    i = len(ptrs) - (2 if checksum and len(ptrs) > 1 else 1)
    nbytes, item = args.aux_data_lens[i], args.aux_item_lens[i]
    if item != 64:
        return None
    return tensor_at(ptrs[i], nbytes, torch.int64, (nbytes // item, 8), aux_device(torch.device(device)))


def init_items(mgr, aux_index: int | None, state_indices=None) -> dict:
    """Keyword arguments for kvstage's init() on either side: the request's aux row and its
    items of the state pools. ValueError when state_indices do not fit this rank's state."""
    items = mgr.state.items(state_indices)
    if aux_index is not None and has_aux(mgr.kv_args):
        items[AUX] = [int(aux_index)]
    return {"pool_items": items} if items else {}


def aux_row_ready(mgr, aux_index: int | None, room: int) -> bool:
    """Decode: whether SGLang may read the request's aux row: its bootstrap_room column names
    the request (room 0 is never used, so a zeroed row never passes)."""
    if aux_index is None or mgr.aux_rooms is None:
        return True
    return int(mgr.aux_rooms[aux_index, 0]) & ((1 << 64) - 1) == room & ((1 << 64) - 1) and room != 0
