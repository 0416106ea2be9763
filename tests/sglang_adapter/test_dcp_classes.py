"""A decode with decode context parallel through SGLang's real transfer classes (scheduler-class
harness): SGLang's --dcp-size 2 on an MLA decode of attention TP 2, so decode rank r holds the
request's tokens t with t % 2 == r, at local slot t // 2, in pages of its own. Each request's
token count (which the plugin's hooks hand to kvstage's sender and receiver) ends inside a
page or on a page's end, some with a decode prefix of whole virtual pages; each decode rank
checks every token it owns, that no slot past the request's end was written, that no page
outside a successful request was, and the aux row. Both backends; with SGLang's staging flag
the prefill relayouts each decode rank's tokens through its staging buffers. A prefill of the
same DCP size (SGLang's N -> N pairing) sends each DCP rank's own pages to the decode's rank of
that DCP rank, with the slots past each request's end holding data that must not move. A hybrid
MLA pool with Mamba slots (Kimi Linear) moves its state beside the split KV."""

from __future__ import annotations

import random

import pytest
from scenario import expect, run

PS, DCP = 4, 2
TOKEN_BYTES = 2 * 8 * 2   # the harness's MLA model: 2 layers of one latent head of 8 bf16 values


def dcp_requests(seed: int, n: int) -> list[dict]:
    """Requests of 1 to 29 tokens past a prefix of 0 or 1 virtual page (PS x DCP tokens)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prefix_tokens = PS * DCP * (i % 2)
        tokens = prefix_tokens + rnd.choice([1, PS - 1, PS, PS + 1, PS * DCP, PS * DCP + 3, rnd.randint(9, 29)])
        pages = -(-tokens // PS)
        suffix = pages - prefix_tokens // PS
        cut = rnd.randint(1, suffix) if suffix > 1 else suffix
        out.append({"room": rnd.randrange(1, 1 << 63), "pages": pages, "prefix": prefix_tokens // PS,
                    "tokens": tokens, "chunks": [c for c in (cut, suffix - cut) if c]})
    return out


@pytest.mark.parametrize("prefill_tp,backend,staging", [(1, "nixl", False), (2, "mooncake", True)],
                         ids=["P1-D2dcp2-nixl", "P2-D2dcp2-mooncake-staged"])
def test_decode_dcp_receives_each_token_on_its_rank(tmp_path, model_dir, bootstrap_server, prefill_tp, backend,
                                                     staging):
    reqs = dcp_requests(55 + prefill_tp, 7)
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, 2, reqs, backend=backend, staging=staging,
                  mla=True, decode_dcp=DCP)
    expect(results, reqs, lambda i: "Success")
    each_rank_got_its_tokens_and_the_aux_row(results, reqs)


@pytest.mark.parametrize("prefill_tp,backend,staging", [(1, "mooncake", False), (2, "nixl", True)],
                         ids=["P1-D2dcp2-mooncake", "P2-D2dcp2-nixl-staged"])
def test_a_kimi_linear_pool_beside_decode_dcp_moves_its_mamba_slots(tmp_path, model_dir, bootstrap_server,
                                                                    prefill_tp, backend, staging):
    """Kimi Linear's shape: a hybrid MLA pool (SGLang's is_hybrid_mla_backend) whose Mamba slots
    (sharded over attention TP on their units, rows before the TP axis, replicated) move beside
    the DCP-split KV. Each decode rank checks its tokens and the aux row as above, and its share
    of every slot's state bit-exact at a slot other than the prefill's; no other slot is written."""
    reqs = dcp_requests(91 + prefill_tp, 6)
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, 2, reqs, backend=backend, staging=staging,
                  mla=True, decode_dcp=DCP, state={"slots": 12, "swa_pages": 0, "mamba_only": True})
    expect(results, reqs, lambda i: "Success")
    rooms = [results[("decode", r)]["rooms"] for r in range(DCP)]
    assert all(rank[str(q["room"])]["state_bad"] == [] for rank in rooms for q in reqs), rooms


def each_rank_got_its_tokens_and_the_aux_row(results, reqs) -> None:
    """Each decode rank received its own tokens' KV and the aux row, nothing else."""
    for q in reqs:
        got = [results[("decode", r)]["rooms"][str(q["room"])]["bytes"] for r in range(DCP)]
        owned = [sum(1 for t in range(q["prefix"] * PS, q["tokens"]) if t % DCP == r) for r in range(DCP)]
        aux = {g - TOKEN_BYTES * o for g, o in zip(got, owned)}
        assert len(aux) == 1 and aux.pop() > 0, (q, got, owned)


def equal_dcp_requests(seed: int, n: int) -> list[dict]:
    """DCP N -> N: requests of 1 to 29 tokens past a prefix of 0 or 1 virtual page; "pages" are
    the prefill's virtual pages (page_size x N tokens each), "prefix" in pages of page_size."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prefix_virtual = i % 2
        tokens = prefix_virtual * PS * DCP + rnd.choice([1, PS - 1, PS, PS + 1, PS * DCP, PS * DCP + 3,
                                                         rnd.randint(9, 29)])
        virtual = -(-tokens // (PS * DCP))
        suffix = virtual - prefix_virtual
        cut = rnd.randint(1, suffix) if suffix > 1 else suffix
        out.append({"room": rnd.randrange(1, 1 << 63), "pages": virtual, "prefix": prefix_virtual * DCP,
                    "tokens": tokens, "chunks": [c for c in (cut, suffix - cut) if c]})
    return out


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_prefill_of_the_decodes_dcp_size_sends_each_rank_its_own_pages(tmp_path, model_dir, bootstrap_server,
                                                                         backend):
    reqs = equal_dcp_requests(77, 7)
    results = run(tmp_path, model_dir, bootstrap_server, 2, 2, reqs, backend=backend, mla=True, decode_dcp=DCP,
                  prefill_dcp=DCP)
    expect(results, reqs, lambda i: "Success")
    each_rank_got_its_tokens_and_the_aux_row(results, reqs)



@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_decode_dcp_beside_a_pp_prefill_gets_each_stages_layer_of_its_tokens(tmp_path, model_dir, bootstrap_server,
                                                                             backend):
    """A PP 2 prefill (SGLang's PP process groups and bootstrap consensus, a layer a stage) into
    decode DCP 2: each decode rank checks every token it owns of both layers, the slots past the
    end and the aux row (from the last stage). A decode of PP 2 with DCP is not run here: SGLang's
    process groups refuse DCP on CPU (kvstage's engine tests move it, tests/integration/test_dcp.py)."""
    reqs = dcp_requests(71, 6)
    results = run(tmp_path, model_dir, bootstrap_server, 1, 2, reqs, backend=backend, mla=True, decode_dcp=DCP,
                  prefill_pp=2)
    expect(results, reqs, lambda i: "Success")
    each_rank_got_its_tokens_and_the_aux_row(results, reqs)
