"""SGLang's real queue methods that start a request's sender and receiver, on a stand-in queue.

A scheduler starts a prefill request's sender in PrefillBootstrapQueue.finalize_bootstrap (the
decode prefix popped, the page count from the request's length, then init()) and sends a decode
request's page indices in DecodePreallocQueue._send_kv_metadata; kvstage's plugin hooks both to
hand the request's token count to its sender and receiver (plugin.tell_prefill_tokens and
tell_decode_tokens). The harness calls these two methods of SGLang's, with the hooks SGLang's
plugin loader applied, on a queue object that holds only the attributes they read (a scheduler's
queues need a model runner and memory pools), and a request with the fields they read.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def finalize_bootstrap(sender, *, tokens: int, page_size: int, row: int) -> int:
    """SGLang's prefill start of the request: returns the decode prefix it popped, in tokens."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    queue = object.__new__(PrefillBootstrapQueue)
    queue.ensure_metadata_buffer = lambda req: True     # the aux row is the harness's
    queue.scheduler = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(page_size=page_size))
    req = SimpleNamespace(pending_bootstrap=True, disagg_kv_sender=sender, origin_input_ids=[0] * tokens,
                          metadata_buffer_index=row, time_stats=SimpleNamespace(set_bootstrap_done_time=lambda: None))
    assert queue.finalize_bootstrap(req) is True
    return int(req.start_send_idx)


def send_kv_metadata(receiver, *, room: int, tokens: int, pages, alloc_page_size: int, prefix_tokens: int,
                     row: int) -> None:
    """SGLang's decode metadata of the request: `pages` are the request's pages past the prefix
    in its allocator's pages of `alloc_page_size` tokens (page_size x dcp_size under decode
    context parallel); SGLang gives their token ids, as its req_to_token row holds them."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest

    queue = object.__new__(DecodePreallocQueue)
    queue.req_to_metadata_buffer_idx_allocator = SimpleNamespace(alloc=lambda: row)
    queue.transfer_queue = SimpleNamespace(enable_staging=False)
    queue._num_published_destinations = 0
    ids = torch.tensor([p * alloc_page_size + o for p in pages for o in range(alloc_page_size)],
                       dtype=torch.int64)[: tokens - prefix_tokens]
    req = SimpleNamespace(origin_input_ids=[0] * tokens, output_ids=[], bootstrap_room=room,
                          time_stats=SimpleNamespace(set_decode_transfer_queue_entry_time=lambda: None))
    queue._send_kv_metadata(DecodeRequest(req=req, kv_receiver=receiver), ids, alloc_page_size, None,
                            decode_prefix_len=prefix_tokens)
