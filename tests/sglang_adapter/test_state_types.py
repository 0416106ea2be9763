"""SGLang state components beyond Mamba/SWA/DSA, built by SGLang 0.5.23's own pool classes on
CPU and described by SGLang's own `setup_state_kv_args`, through the adapter's StateMap (pools at
start, state_indices as pool items), then moved the way kvstage moves state pools: for each
(prefill rank -> decode rank) KV flow, the pool segments that flow carries
(`pool_parts.writer_segments` / `request_copies`), gathered out of the prefill rank's tensors and
scattered into the decode rank's (`staging/pool_copies.py`), in one process and without a
transport (the engine moving pools between processes is tests/integration/test_state_pools.py).
Each case checks every byte the decode ranks hold against the prefill ranks' bytes as SGLang's
mooncake backend pairs them, and that nothing else was written. Seconds, no servers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.adapters.sglang.geometry import kv_layout
from kvstage.adapters.sglang.state import StateMap
from kvstage.staging.pool_copies import LandedBlock, PoolBytes, gather_pools, scatter_pools
from kvstage.transfer.pool_spec import pool_mismatches
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.pool_parts import counts_mismatch, request_copies, writer_segments

SENTINEL = 0x5A


def sglang_rank(pool, tp: int, rank: int, total_heads: int, mla: bool = False, **state_kw) -> dict:
    """One rank: SGLang's KVArgs for `pool` (its KV buffers and, through setup_state_kv_args, its
    state components) and the adapter's layout and StateMap of them."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos, setup_state_kv_args

    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    args.page_size = pool.page_size
    args.kv_head_num, args.total_kv_head_num = max(1, total_heads // tp), total_heads
    setup_state_kv_args(args, pool)
    layout = kv_layout(args, tp, rank, mla)
    return {"pool": pool, "args": args, "layout": layout,
            "state": StateMap(args, layout, torch.device("cpu"), tp, **state_kw)}


def move(prefill: list[dict], decode: list[dict], p_indices: list, d_indices: list, total_heads: int,
         mla: bool = False) -> None:
    """kvstage's state pool copies of one request between the ranks (module docstring)."""
    for side in prefill + decode:
        side["specs"] = [p.spec(n, side["layout"]) for n, p in side["state"].pools.items()]
    assert pool_mismatches(prefill[0]["specs"], decode[0]["specs"]) == []
    P, D = len(prefill), len(decode)
    assert decode[0]["state"].peer_problem(P, D) is None
    for d in range(D):
        dst_items = decode[d]["state"].items(d_indices)
        for a in compute_assignments(P, D, total_heads, mla).for_decode(d):
            src_items = prefill[a.prefill_rank]["state"].items(p_indices)
            assert counts_mismatch(src_items, {k: v.size for k, v in dst_items.items()}) == ""
            copies = request_copies(writer_segments(prefill[a.prefill_rank]["specs"], P, D, a), src_items, dst_items)
            block = torch.empty(sum(c.nbytes for c in copies), dtype=torch.uint8)
            gather_pools(PoolBytes(prefill[a.prefill_rank]["state"].pools), copies, block, 0)
            scatter_pools(PoolBytes(decode[d]["state"].pools),
                          [LandedBlock(block[c.offset:c.offset + c.nbytes], c) for c in copies])


def fill(tensors, seed: int | None) -> None:
    g = torch.Generator().manual_seed(seed or 0)
    for t in tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8) if seed is not None
                else torch.full(b.shape, SENTINEL, dtype=torch.uint8))


# --- MXFP8 block scales (StateType.BLOCK_SCALE: MHATokenToKVPoolMXFP8) ---------------------------

def mxfp8_pool(page: int, pages: int, local_heads: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    return MHATokenToKVPoolMXFP8(size=page * pages, page_size=page, dtype=torch.float8_e4m3fn, head_num=local_heads,
                                 head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)


def scales_by_page_head(t: torch.Tensor, page: int) -> torch.Tensor:
    """A scale tensor as [pages, local heads, bytes of that head in that page], from its shape as
    SGLang allocates it: [tokens, heads, sf] or, interleaved, [pages, heads, 32, page/32, sf]."""
    b = t.view(torch.uint8)
    if b.dim() == 3:
        return b.reshape(-1, page, b.shape[1], b.shape[2]).permute(0, 2, 1, 3).reshape(b.shape[0] // page, b.shape[1], -1)
    return b.reshape(b.shape[0], b.shape[1], -1)


@pytest.mark.parametrize("page", [4, 128], ids=["per-token", "interleaved"])
@pytest.mark.parametrize("ptp,dtp", [(2, 2), (2, 1), (1, 2)])
def test_mxfp8_block_scales_move_with_their_heads(page, ptp, dtp):
    """The scales of a request's pages land on the decode pages SGLang names, each decode rank with
    its own heads' scales, in both of SGLang's scale layouts (per token; interleaved per page at
    page size 128). SGLang's own manager refuses MXFP8 across attention TP sizes for every backend
    (CommonKVManager.try_ensure_parallel_info); the pools split correctly there too."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.mem_cache.common import kv_to_page_indices

    heads = 4
    prefill = [sglang_rank(mxfp8_pool(page, 6, heads // ptp), ptp, r, heads) for r in range(ptp)]
    decode = [sglang_rank(mxfp8_pool(page, 9, heads // dtp), dtp, r, heads) for r in range(dtp)]
    assert prefill[0]["args"].state_types == [StateType.BLOCK_SCALE]
    assert {n: (p.sharding, p.heads) for n, p in decode[0]["state"].pools.items()} == {"state0.block_scale": ("heads", 4)}
    for i, side in enumerate(prefill):
        fill(side["pool"].k_scale_buffer + side["pool"].v_scale_buffer, 1 + i)
    for side in decode:
        fill(side["pool"].k_scale_buffer + side["pool"].v_scale_buffer, None)
    src_pages, dst_pages = [3, 1, 5], [2, 8, 4]

    def payload(pages):     # SGLang's _full_kv_pages_payload of a request on these pages
        tokens = torch.tensor([p * page + t for p in pages for t in range(page)])
        return [kv_to_page_indices(tokens, page)]

    move(prefill, decode, payload(src_pages), payload(dst_pages), heads)
    n_scale = len(prefill[0]["pool"].k_scale_buffer) * 2
    for j in range(n_scale):
        whole = torch.cat([scales_by_page_head((s["pool"].k_scale_buffer + s["pool"].v_scale_buffer)[j], page)
                           for s in prefill], dim=1)                     # [pages, all heads, bytes]
        for d, side in enumerate(decode):
            got = scales_by_page_head((side["pool"].k_scale_buffer + side["pool"].v_scale_buffer)[j], page)
            local = heads // dtp
            for sp, dp in zip(src_pages, dst_pages):
                assert torch.equal(got[dp], whole[sp, d * local:(d + 1) * local]), (j, d, dp)
            others = [p for p in range(got.shape[0]) if p not in dst_pages]
            assert bool((got[others] == SENTINEL).all()), f"scale tensor {j} rank {d}: a page no request names was written"


def test_a_sliding_window_model_with_mxfp8_moves_its_window_and_both_scale_pools():
    """SGLang's SWAKVPool with MXFP8 sub-pools: three components, the window's KV pages (SWA), the
    full layers' scales (BLOCK_SCALE, every page of the request) and the window layers' scales
    (BLOCK_SCALE_SWA, the window's pages), each with its own page list, prefill TP 1 -> decode TP 2."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    page, heads, ptp, dtp = 4, 2, 1, 2

    def pool(pages: int, tp: int):
        return SWAKVPool(size=page * pages, size_swa=page * (pages - 2), page_size=page, dtype=torch.float8_e4m3fn,
                         head_num=heads // tp, head_dim=64, swa_attention_layer_ids=[0, 2],
                         full_attention_layer_ids=[1], device="cpu", token_to_kv_pool_class=MHATokenToKVPoolMXFP8,
                         enable_memory_saver=False)

    def parts(p) -> dict:
        return {"swa": p.swa_kv_pool.k_buffer + p.swa_kv_pool.v_buffer,
                "block_scale": p.full_kv_pool.k_scale_buffer + p.full_kv_pool.v_scale_buffer,
                "block_scale_swa": p.swa_kv_pool.k_scale_buffer + p.swa_kv_pool.v_scale_buffer}

    prefill = [sglang_rank(pool(8, ptp), ptp, r, heads) for r in range(ptp)]
    decode = [sglang_rank(pool(11, dtp), dtp, r, heads) for r in range(dtp)]
    assert prefill[0]["args"].state_types == [StateType.SWA, StateType.BLOCK_SCALE, StateType.BLOCK_SCALE_SWA]
    for i, side in enumerate(prefill):
        fill([t for ts in parts(side["pool"]).values() for t in ts], 7 + i)
    for side in decode:
        fill([t for ts in parts(side["pool"]).values() for t in ts], None)
    full = ([3, 1, 5, 6], [2, 8, 4, 9])           # (prefill, decode) pages of the whole request
    window = ([2, 4], [7, 1])                     # the window's pages in the SWA sub-pool
    as_indices = {"swa": window, "block_scale": full, "block_scale_swa": window}
    p_idx = [np.asarray(as_indices[k][0], dtype=np.int32) for k in parts(prefill[0]["pool"])]
    d_idx = [np.asarray(as_indices[k][1], dtype=np.int32) for k in parts(prefill[0]["pool"])]
    move(prefill, decode, p_idx, d_idx, heads)
    for kind, (src_pages, dst_pages) in as_indices.items():
        for j in range(len(parts(prefill[0]["pool"])[kind])):
            whole = torch.cat([scales_by_page_head(parts(s["pool"])[kind][j], page) for s in prefill], dim=1)
            for d, side in enumerate(decode):
                got = scales_by_page_head(parts(side["pool"])[kind][j], page)
                local = heads // dtp
                for sp, dp in zip(src_pages, dst_pages):
                    assert torch.equal(got[dp], whole[sp, d * local:(d + 1) * local]), (kind, j, d, dp)
                others = [p for p in range(got.shape[0]) if p not in dst_pages]
                assert bool((got[others] == SENTINEL).all()), f"{kind} tensor {j} rank {d}: an unnamed page was written"


# --- QSA index state (StateType.QSA_PENDING / QSA_COMPRESSED: QSATokenToKVPool) -----------------

def qsa_pool(tp: int, slots: int, pages: int):
    """SGLang's QSA hybrid pool (Mamba layers 0 and 2 in SGLang's MambaPool, full attention with
    QSA at layers 1 and 3), this rank's share of 2 KV heads and 4 Mamba heads."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16,
                                    state_size=8, conv_kernel=4)
    mamba = MambaPool(size=slots, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                      mamba_layer_ids=[0, 2], device="cpu")
    return QSATokenToKVPool(size=8 * pages, dtype=torch.bfloat16, page_size=8, head_num=2 // tp, head_dim=16,
                            full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mamba, qsa_index_kv_heads=1,
                            qsa_index_head_dim=32, qsa_compress_ratio=4, qsa_token_topk=8, num_request_slots=slots)


def qsa_parts(p) -> dict:
    return {"qsa_pending": p.qsa_key_state_buffer_pool + [p.qsa_rope_position_buffer],
            "qsa_compressed": p.qsa_compressed_k_buffer_pool}


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2)])
def test_qsa_index_state_moves_to_every_decode_rank(ptp, dtp):
    """A request's QSA pending ring row (SGLang's get_qsa_pending_state_indices: its request slot,
    `ratio` ring rows per slot) and the compressed keys of its pages land in the decode's slot and
    pages on every decode rank, whatever the TP sizes; the Mamba state of the same pool moves too."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import get_qsa_pending_state_indices
    from sglang.srt.mem_cache.common import kv_to_page_indices

    prefill = [sglang_rank(qsa_pool(ptp, 5, 8), ptp, r, 2) for r in range(ptp)]
    decode = [sglang_rank(qsa_pool(dtp, 7, 11), dtp, r, 2) for r in range(dtp)]
    assert prefill[0]["args"].state_types == [StateType.MAMBA, StateType.QSA_PENDING, StateType.QSA_COMPRESSED]
    assert {n: p.sharding for n, p in decode[0]["state"].pools.items() if "qsa" in n} == {
        "state1.qsa_pending": "replicated", "state2.qsa_compressed": "replicated"}
    for side in prefill:       # replicated over TP: every prefill rank holds the same bytes
        fill([t for ts in qsa_parts(side["pool"]).values() for t in ts], 3)
    for side in decode:
        fill([t for ts in qsa_parts(side["pool"]).values() for t in ts], None)
    (src_slot, dst_slot), (src_pages, dst_pages) = (2, 6), ([3, 1, 5], [2, 9, 4])

    def indices(slot, pages):
        req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=slot))
        tokens = torch.tensor([p * 8 + t for p in pages for t in range(8)])
        return [[np.array([slot])], get_qsa_pending_state_indices(req), kv_to_page_indices(tokens, 8)]

    move(prefill, decode, indices(src_slot, src_pages), indices(dst_slot, dst_pages), 2)
    ratio, per_page = 4, 2          # pending: 4 ring rows per request slot; compressed: 8 / 4 rows per page
    for kind, rows, pairs in (("qsa_pending", ratio, [(src_slot, dst_slot)]),
                              ("qsa_compressed", per_page, list(zip(src_pages, dst_pages)))):
        for j, src_t in enumerate(qsa_parts(prefill[0]["pool"])[kind]):
            for d, side in enumerate(decode):
                got = qsa_parts(side["pool"])[kind][j].view(torch.uint8)
                written = torch.zeros(got.shape[0], dtype=torch.bool)
                for s, t in pairs:
                    assert torch.equal(got[t * rows:(t + 1) * rows], src_t.view(torch.uint8)[s * rows:(s + 1) * rows]), \
                        (kind, j, d, t)
                    written[t * rows:(t + 1) * rows] = True
                assert bool((got[~written] == SENTINEL).all()), f"{kind} tensor {j} rank {d}: an unnamed row was written"


# --- DSA kpool-compress tail (StateType.DSA_TAIL: DSATokenToKVPool in a hybrid DSA pool) ---------

def dsa_pool(tail_extra_slots: int, slots: int, pages: int):
    """SGLang's hybrid Mamba + DSA pool (MLA latents with the DSA indexer at layers 1 and 3), index
    kpool 4 with compression: a tail ring of 4 + tail_extra_slots token slots per request row."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
    from sglang.srt.runtime_context import get_parallel

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16,
                                    state_size=8, conv_kernel=4)
    mamba = MambaPool(size=slots, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                      mamba_layer_ids=[0, 2], device="cpu")
    with get_parallel().override(attn_dcp_size=1):
        return HybridLinearKVPool(size=256 * pages, dtype=torch.bfloat16, page_size=256, head_num=1, head_dim=576,
                                  full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mamba, use_mla=True,
                                  kv_lora_rank=512, qk_rope_head_dim=64, use_dsa=True, index_head_dim=128,
                                  kv_cache_dim=576, index_kpool=4, index_kpool_compress=True,
                                  tail_extra_slots=tail_extra_slots, max_running_requests=slots)


def tails(p) -> list:
    return p.full_kv_pool._compress_tail_k + p.full_kv_pool._compress_tail_score


def mooncake_reference(src: list, dst: list, src_items: list, dst_items: list, src_idx: list, dst_idx: list) -> list:
    """The decode tensors after SGLang's mooncake backend's DSA tail copies
    (build_dsa_tail_transfer_blocks: absolute (src, dst, length) blocks), applied to clones."""
    from sglang.srt.disaggregation.utils import build_dsa_tail_transfer_blocks

    out = [t.clone() for t in dst]
    blocks = build_dsa_tail_transfer_blocks([t.data_ptr() for t in src], src_items, [t.data_ptr() for t in dst],
                                            list(src_idx), list(dst_idx), dst_items)
    assert blocks, "the case moves no live tail slot"

    def where(tensors, addr):
        for k, t in enumerate(tensors):
            if t.data_ptr() <= addr < t.data_ptr() + t.nbytes:
                return k, addr - t.data_ptr()
        raise AssertionError(f"address {addr:#x} in no tensor")

    for s_addr, d_addr, n in blocks:
        (i, a), (k, b) = where(src, s_addr), where(dst, d_addr)
        out[k].view(torch.uint8).view(-1)[b:b + n] = src[i].view(torch.uint8).view(-1)[a:a + n]
    return out


@pytest.mark.parametrize("seq_len", [7, 23, 40], ids=["wraps", "one-segment", "no-live-slot"])
def test_dsa_tail_live_slots_land_where_sglang_mooncake_puts_them(seq_len):
    """A request's live tail tokens (seq_len % 4 of them) move from the prefill's ring (4 slots) to
    the decode's (6: two speculative slots), at the slots SGLang's get_dsa_tail_state_indices names
    on each side, wrapping around the decode's ring where it does: byte for byte what SGLang's
    mooncake backend writes, and nothing else. A request with no live slot moves no tail byte."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

    slot_bytes = 128 * 2
    prefill = [sglang_rank(dsa_pool(0, 4, 3), 1, 0, 1, mla=True, dsa_tail_slot_bytes=slot_bytes)]
    decode = [sglang_rank(dsa_pool(2, 6, 4), 1, 0, 1, mla=True, dsa_tail_slot_bytes=slot_bytes)]
    assert prefill[0]["args"].state_types == [StateType.MAMBA, StateType.DSA, StateType.DSA_TAIL]
    src, dst = tails(prefill[0]["pool"]), tails(decode[0]["pool"])
    fill(src, 5)
    fill(dst, None)
    (src_row, dst_row), pages = (3, 5), ([1, 2], [3, 0])
    p_tail = get_dsa_tail_state_indices(prefill[0]["pool"], src_row, seq_len)
    d_tail = get_dsa_tail_state_indices(decode[0]["pool"], dst_row, seq_len)
    want = (mooncake_reference(src, dst, prefill[0]["args"].state_item_lens[2], decode[0]["args"].state_item_lens[2],
                               p_tail, d_tail) if p_tail else [t.clone() for t in dst])
    move(prefill, decode, [[np.array([src_row])], np.array(pages[0]), p_tail],
         [[np.array([dst_row])], np.array(pages[1]), d_tail], 1, mla=True)
    for j, (got, w) in enumerate(zip(dst, want)):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), f"DSA tail tensor {j}"


def test_dsa_tail_slot_bytes_come_from_the_model_config(tmp_path):
    """What the manager gives StateMap (geometry.dsa_tail_slot_bytes): the DSA index_head_dim of
    the model's config, read as SGLang sizes the tail ring, in bf16; nothing without a DSA tail."""
    import json
    from types import SimpleNamespace

    from sglang.srt.server_args import ServerArgs

    from kvstage.adapters.sglang.geometry import dsa_tail_slot_bytes

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "kv_lora_rank": 64, "q_lora_rank": 32, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "index_head_dim": 96, "index_n_heads": 4, "index_topk": 64,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1}))
    sa = ServerArgs(model_path=str(tmp_path), device="cpu", skip_tokenizer_init=True, disaggregation_mode="decode")
    assert dsa_tail_slot_bytes(SimpleNamespace(state_types=["mamba", "dsa", "dsa_tail"]), sa) == 96 * 2
    assert dsa_tail_slot_bytes(SimpleNamespace(state_types=["mamba", "dsa"]), sa) is None


def test_dsa_tail_indices_that_do_not_fit_fail_the_request():
    """A ring size other than this rank's, or slots past its end: a clear error (which fails the
    request on both sides in the adapter), never a write elsewhere in the ring."""
    side = sglang_rank(dsa_pool(0, 4, 3), 1, 0, 1, mla=True, dsa_tail_slot_bytes=256)
    tail = side["state"].items([None, None, [3, 1, 2, 0, 0, 4]])
    assert {k: v.tolist() for k, v in tail.items()} == {"state2.dsa_tail": [13, 14]}
    with pytest.raises(ValueError, match="DSA tail ring of 6 slots, this rank's tail rows hold 4"):
        side["state"].items([None, None, [3, 1, 2, 0, 0, 6]])
    with pytest.raises(ValueError, match="does not fit a ring of 4 slots"):
        side["state"].items([None, None, [3, 3, 2, 0, 0, 4]])
    with pytest.raises(NotImplementedError, match="DSA tail state without the bytes of one tail slot"):
        sglang_rank(dsa_pool(0, 4, 3), 1, 0, 1, mla=True)


# --- MiniMax sparse attention (StateType.MINIMAX_INDEX_K / MINIMAX_DENSE_KV) -----------------------

def minimax_pool(tp: int, pages: int):
    """SGLang's MiniMaxSparseKVPool: layer 0 dense, layers 1-2 sparse with K-only index heads."""
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool
    return MiniMaxSparseKVPool(size=4 * pages, page_size=4, dtype=torch.bfloat16, head_num=2 // tp, head_dim=16,
                               idx_head_dim=32, dense_layer_ids=[0], sparse_layer_ids=[1, 2], device="cpu",
                               disable_value_sparse_layer_ids=[1, 2], start_layer=0, end_layer=3)


def minimax_parts(p) -> dict:
    return {"minimax_index_k": list(p.index_k_pool.k_buffer),
            "minimax_dense_kv": [p.get_key_buffer(0), p.get_value_buffer(0)]}


@pytest.mark.parametrize("ptp,dtp", [(2, 2), (1, 2)])
def test_minimax_index_keys_and_dense_kv_move_to_the_decode_pages(ptp, dtp):
    """The index keys of the pages after the decode's cached prefix (SGLang's
    minimax_index_transfer_pages) reach every decode rank whole; the dense layer's KV of every
    page of the request reaches each decode rank with its heads. (SGLang's own manager refuses
    MiniMax across attention TP sizes for every backend; 1 -> 2 checks the head split anyway.)"""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages
    from sglang.srt.mem_cache.common import kv_to_page_indices

    prefill = [sglang_rank(minimax_pool(ptp, 8), ptp, r, 2) for r in range(ptp)]
    decode = [sglang_rank(minimax_pool(dtp, 11), dtp, r, 2) for r in range(dtp)]
    assert len(prefill[0]["args"].kv_data_ptrs) == 4      # the KV entries are the sparse layers' K and V
    assert prefill[0]["args"].state_types == [StateType.MINIMAX_INDEX_K, StateType.MINIMAX_DENSE_KV]
    for i, side in enumerate(prefill):
        fill(minimax_parts(side["pool"])["minimax_dense_kv"], 11 + i)
        fill(minimax_parts(side["pool"])["minimax_index_k"], 10)       # the same on every rank
    for side in decode:
        fill([t for ts in minimax_parts(side["pool"]).values() for t in ts], None)
    src_pages, dst_pages, prefix = [3, 1, 5, 6], [2, 9, 4, 7], 4      # one cached page on decode

    def indices(pages):
        tokens = torch.tensor([p * 4 + t for p in pages for t in range(4)])
        return [minimax_index_transfer_pages(tokens, page_size=4, prefix_len=prefix), kv_to_page_indices(tokens, 4)]

    move(prefill, decode, indices(src_pages), indices(dst_pages), 2)
    for kind, pairs in (("minimax_index_k", list(zip(src_pages, dst_pages))[1:]),
                        ("minimax_dense_kv", list(zip(src_pages, dst_pages)))):
        for j in range(len(minimax_parts(prefill[0]["pool"])[kind])):
            whole = torch.cat([scales_by_page_head(minimax_parts(s["pool"])[kind][j], 4) for s in prefill], dim=1)
            if kind == "minimax_index_k":
                whole = scales_by_page_head(minimax_parts(prefill[0]["pool"])[kind][j], 4)
            for d, side in enumerate(decode):
                got = scales_by_page_head(minimax_parts(side["pool"])[kind][j], 4)
                local = got.shape[1]
                heads = slice(0, 1) if kind == "minimax_index_k" else slice(d * local, (d + 1) * local)
                for sp, dp in pairs:
                    assert torch.equal(got[dp], whole[sp, heads]), (kind, j, d, dp)
                others = [p for p in range(got.shape[0]) if p not in [dp for _, dp in pairs]]
                assert bool((got[others] == SENTINEL).all()), f"{kind} tensor {j} rank {d}: an unnamed page was written"


# --- An MHA draft model beside an MLA target (EAGLE3 on a DeepSeek-style model) ---------------------

def mla_with_mha_draft(tp: int, rank: int, pages: int) -> dict:
    """A rank's KVArgs as SGLang's prefill/decode build them with a separate draft model: the MLA
    target's latents (MLATokenToKVPool), then the draft's K and V (MHATokenToKVPool, this rank's
    share of its 8 KV heads), num_draft_entries 2; the adapter's layout and kvstage buffers."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    from kvstage.adapters.sglang.pools import make_buffers

    target = MLATokenToKVPool(size=4 * pages, page_size=4, dtype=torch.bfloat16, kv_lora_rank=64,
                              qk_rope_head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False)
    draft = MHATokenToKVPool(size=4 * pages, page_size=4, dtype=torch.bfloat16, head_num=8 // tp, head_dim=32,
                             layer_num=1, device="cpu", enable_memory_saver=False)
    args = KVArgs()
    t, d = target.get_contiguous_buf_infos(), draft.get_contiguous_buf_infos()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = (t[i] + d[i] for i in range(3))
    args.num_draft_entries, args.page_size = len(d[0]), 4
    server_args = SimpleNamespace(speculative_algorithm="EAGLE3")
    layout = kv_layout(args, tp, rank, True, server_args)
    buffers = make_buffers(layout, args, "cpu", {}).validate(layout)
    return {"draft": draft, "args": args, "layout": layout, "buffers": buffers, "server_args": server_args}


def test_an_mha_draft_beside_an_mla_target_moves_rank_to_rank_at_equal_tp():
    """Each decode rank receives the draft K and V of its own heads for the request's pages, from
    the prefill rank of the same attention TP rank (the one writing its latents), as SGLang's
    mooncake backend pairs them; across TP sizes the manager marks it for the decode to fail the
    request (draft_equal_tp_only)."""
    from kvstage.adapters.sglang.geometry import draft_equal_tp_only
    from kvstage.transfer.draft_kv import draft_items

    tp = 2
    prefill = [mla_with_mha_draft(tp, r, 6) for r in range(tp)]
    decode = [mla_with_mha_draft(tp, r, 9) for r in range(tp)]
    assert all(draft_equal_tp_only(s["args"], True, s["server_args"]) for s in prefill + decode)
    for i, side in enumerate(prefill):
        fill(side["draft"].k_buffer + side["draft"].v_buffer, 20 + i)
    for side in decode:
        fill(side["draft"].k_buffer + side["draft"].v_buffer, None)
    src_pages, dst_pages = [4, 1, 3], [2, 7, 5]
    for side in prefill + decode:
        side["specs"] = [p.spec(n, side["layout"]) for n, p in side["buffers"].pools.items()]
    assert pool_mismatches(prefill[0]["specs"], decode[0]["specs"]) == []
    for d in range(tp):
        for a in compute_assignments(tp, tp, 1, True).for_decode(d):
            src = {n: draft_items(np.array(src_pages), 4) for n in prefill[a.prefill_rank]["buffers"].pools}
            dst = {n: draft_items(np.array(dst_pages), 4) for n in decode[d]["buffers"].pools}
            copies = request_copies(writer_segments(prefill[a.prefill_rank]["specs"], tp, tp, a), src, dst)
            block = torch.empty(sum(c.nbytes for c in copies), dtype=torch.uint8)
            gather_pools(PoolBytes(prefill[a.prefill_rank]["buffers"].pools), copies, block, 0)
            scatter_pools(PoolBytes(decode[d]["buffers"].pools),
                          [LandedBlock(block[c.offset:c.offset + c.nbytes], c) for c in copies])
    for d, side in enumerate(decode):
        for j, got in enumerate(side["draft"].k_buffer + side["draft"].v_buffer):
            want = (prefill[d]["draft"].k_buffer + prefill[d]["draft"].v_buffer)[j]
            got_p, want_p = scales_by_page_head(got, 4), scales_by_page_head(want, 4)
            for sp, dp in zip(src_pages, dst_pages):
                assert torch.equal(got_p[dp], want_p[sp]), (d, j, dp)
            others = [p for p in range(got_p.shape[0]) if p not in dst_pages]
            assert bool((got_p[others] == SENTINEL).all()), f"draft tensor {j} rank {d}: an unnamed page was written"
