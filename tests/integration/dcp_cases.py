"""Decode context parallel cases between real processes (tests/integration/test_dcp.py, and on
VRAM tests/gpu/test_gpu_dcp.py): prefill TP 2 -> decode TP 2 DCP 2 rooms of every awkward shape,
and the check that each decode rank took exactly its tokens, bit-exact."""

from __future__ import annotations

from engine_cases import LAYERED_AUX, Case, Topo, each_rank

from kvstage.transfer.protocol.token_mapping import DCPLayout, local_pages

PS = 4


SHAPES = [(1, 0), (7, 0), (8, 0), (37, 1), (61, 2), (5, 0)]   # (tokens, decode prefix in local pages)
WANT = {0: 1, 1: 7, 2: 8, 3: 37 - 8, 4: 61 - 16, 5: 5}     # tokens moved past the prefix, per room


def split_case(backend: str, prefill_dcp: int = 1, base: int = 3300, aux: bool = False,
               buffer_bytes: int = 0, head_dim: int = 16, device: str | None = None,
               own_writes: bool = False) -> Case:
    """Prefill TP 2 / DCP `prefill_dcp` (1 or 2) -> decode TP 2 DCP 2, pages of 4 tokens (a
    virtual page of 8): one token, a partial last page, whole virtual pages, prefixes of one and
    two virtual pages, in uneven chunks on the prefill side (MLA: decode rank d is written by
    prefill rank d % 2, which holds the same DCP rank when the prefill has DCP 2). `aux`: each
    request also carries an aux row (SGLang's first output token), one item of a replicated pool
    on every rank, which each decode rank gets whole (the one-token request's rank 1, owning no
    token, gets it alone). `buffer_bytes`: staging on, the prefill ranks' buffers of that size
    (each decode rank's tokens gathered into one before they are written: token_mapping.Relayout);
    0: staging off, every token run written from the cache. `device`: the KV caches' (and
    buffers') device on both sides ("cuda:0"; None: the host). `own_writes`: the aux pool is
    written on its own (StatePool.own_writes, as a host pool beside a VRAM cache), so a write
    carrying it cannot be relayouted and goes as token runs."""
    dec = DCPLayout(dcp_size=2, page_size=PS, mla=True)
    pre = DCPLayout(dcp_size=prefill_dcp, page_size=PS, mla=True)
    pre_rooms, dec_rooms = [], []
    for i, (tokens, prefix) in enumerate(SHAPES):
        room = base + i
        pages = local_pages(pre, tokens)
        chunks = [pages] if pages < 4 else [1, pages - 3, 2]
        items = {"pool_items": {"aux": 1}} if aux else {}
        pre_rooms.append({"room": room, "pages": pages, "chunks": chunks, "dcp_tokens": tokens, **items})
        rec = {"room": room, "pages": local_pages(dec, tokens), "dcp_tokens": tokens, **items}
        if prefix:
            rec["prefix_pages"] = prefix
        dec_rooms.append(rec)
    staged = {"buffer_mb": buffer_bytes / (1 << 20)} if buffer_bytes else {}
    on = {"device": device} if device else {}
    return Case(topo=Topo(P=2, D=2, H=1, mla=True), page_size=PS, dtype="bfloat16", backend=backend, layers=2,
                head_dim=head_dim, pages=64, label=f"dcp{prefill_dcp}2{'aux' if aux else ''}{'own' if own_writes else ''}{buffer_bytes or ''}",
                staging=bool(buffer_bytes), prefill_extra={"rooms": pre_rooms, "dcp": prefill_dcp, **staged, **on},
                decode_extra={"rooms": dec_rooms, "dcp": 2, **on},
                pools={"aux": {**LAYERED_AUX, "own_writes": own_writes}} if aux else {})


def check_moved(moved: list[Case], results: dict, relayouts: dict[str, int]) -> None:
    """Every room of every case Success on every rank; each decode rank holding exactly its tokens
    past the prefix, bit-exact, the rest of its pages and its prefix untouched; the two decode
    ranks (of each decode PP stage) together every token; and each case's prefill ranks having made `relayouts[name]`
    relayout writes (0 where not named)."""
    for case in moved:
        by_room: dict[int, int] = {}
        for _c, side, res in each_rank([case], results):
            assert len(res["rooms"]) == 6, (side, res)
            for rec in res["rooms"]:
                assert rec["state"] == "Success", (side, rec)
                if side == "decode":
                    assert rec["verified"] is True and rec["dcp_rest_untouched"] is True, rec
                    assert rec.get("prefix_intact", True) is True, rec
                    by_room[rec["room"] % 100] = by_room.get(rec["room"] % 100, 0) + rec["dcp_tokens"]
        # the two DCP ranks (of each decode PP stage) took every token past the prefix
        assert by_room == {room: n * case.topo.dpp for room, n in WANT.items()}, case.name
        made = sum(res["stats"].get("relayout_writes", 0) for _c, side, res in each_rank([case], results)
                   if side == "prefill")
        assert made == relayouts.get(case.name, 0), (case.name, made)
