"""kvstage's plugin hooks on SGLang's real queue methods: the request's token count reaches
kvstage's sender before SGLang's init() and its receiver before send_metadata() (what kvstage
needs under decode context parallel, which SGLang's sender and receiver interfaces do not carry).

SGLang's PrefillBootstrapQueue.finalize_bootstrap and DecodePreallocQueue._send_kv_metadata run
as SGLang 0.5.23 has them, with the hooks SGLang's plugin loader applied, on a stand-in queue
(queue_calls.py); the sender and receiver are kvstage's classes with their kvstage side stood in
by recorders (no engine: what is checked is what SGLang hands them, and when)."""

from __future__ import annotations

import numpy as np
import pytest
from queue_calls import finalize_bootstrap, send_kv_metadata


@pytest.fixture(scope="module")
def classes():
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from kvstage.adapters.sglang import conn
    return conn


def test_the_prefill_sender_knows_the_requests_tokens_before_init(classes):
    sender = object.__new__(classes.KvstageKVSender)
    calls = []
    sender.pop_decode_prefix_len = lambda: 8
    sender.init = lambda num_kv_indices, aux_index=None: calls.append((sender.request_tokens, num_kv_indices,
                                                                       aux_index))
    assert finalize_bootstrap(sender, tokens=19, page_size=4, row=3) == 8
    assert calls == [(19, 3, 3)]     # 19 tokens, 8 of them the decode's prefix: 3 pages of 4 to send


def test_the_decode_receiver_knows_the_requests_tokens_before_send_metadata(classes):
    receiver = object.__new__(classes.KvstageKVReceiver)
    calls = []
    receiver.send_metadata = lambda pages, row, state, **kw: calls.append(
        (receiver.request_tokens, np.asarray(pages).tolist(), row, kw.get("decode_prefix_len")))
    # decode context parallel 2 of 4-token pages: SGLang's allocator pages hold 8 tokens
    send_kv_metadata(receiver, room=5, tokens=19, pages=[6, 2], alloc_page_size=8, prefix_tokens=8, row=4)
    assert calls == [(19, [6, 2], 4, 8)]
