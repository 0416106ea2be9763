"""SGLang's `--disaggregation-decode-allocation-policy prefill_complete` for backend kvstage.

Under that policy a decode reserves a request's KV pages only once the prefill has computed the
request, so a long prefill does not hold decode memory while it runs. SGLang 0.5.23's
protocol for it (its Common* classes, which kvstage's classes subclass):

1. the decode's receiver, at init(), sends BOOTSTRAP (room, its IP, its rank port) to the
   prefill rank's socket (`announce`);
2. the prefill's manager joins that endpoint with the sender's mark_prefill_complete() in
   SGLang's DeferredBootstrap table and answers WaitingForInput on SGLang's status channel;
3. the decode's receiver polls WaitingForInput, SGLang reserves the pages and calls
   send_metadata(), and kvstage moves the KV as for any request.

A request that ends before its metadata travels the same channel: the decode's ABORT
(`withdraw`), the prefill's Failed status (the sender's failure, or its clear() before it
succeeded). Once the metadata is sent, kvstage's own messages carry everything.

`BootstrapChannel` runs the one part SGLang leaves to a backend: a thread on the manager's
socket (`server_socket`, bound by CommonKVManager), handing each message to SGLang's own
handler (prefill: `_handle_bootstrap_message`; decode: `parse_kv_status_message`, then
`apply_prefill_status`). It blocks on that socket and on a stop socket of its own; close()
stops it before anyone closes the manager's socket. SGLang accepts the policy only with
attention TP 1 (no CP, no PP) on both sides (`peer_problem` names a prefill that differs).
"""

from __future__ import annotations

import logging
import threading

import zmq

log = logging.getLogger("kvstage.sglang")

POLICY = "prefill_complete"


class BootstrapChannel:
    """The thread that reads SGLang's bootstrap and status messages on a manager's socket."""

    def __init__(self, mgr, *, prefill: bool) -> None:
        self._mgr, self._prefill = mgr, prefill
        address = f"inproc://kvstage-sglang-bootstrap-stop-{id(self)}"
        self._stop_rx = mgr._zmq_ctx.socket(zmq.PAIR)
        self._stop_rx.bind(address)
        self._stop_tx = mgr._zmq_ctx.socket(zmq.PAIR)
        self._stop_tx.connect(address)
        self._thread = threading.Thread(target=self._run, name="kvstage-sglang-bootstrap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._mgr.server_socket, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_rx in ready:
                return
            msg = self._mgr.server_socket.recv_multipart()
            try:
                self._handle(msg)
            except Exception:   # noqa: BLE001 - SGLang's handler failed on one message; the next may be fine
                log.exception("kvstage: SGLang's handler failed on a bootstrap message (%d frames); the request it "
                              "named ends at its timeout", len(msg))

    def _handle(self, msg: list[bytes]) -> None:
        mgr = self._mgr
        if self._prefill:
            if not mgr._handle_bootstrap_message(msg) and msg[:1] != [b"ABORT"]:
                log.warning("kvstage: dropped a message that is not SGLang's BOOTSTRAP or ABORT (%d frames)", len(msg))
            return
        parsed = mgr.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, prefill_rank, reason = parsed
            mgr.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                     failure_reason=reason)

    def close(self) -> None:
        self._stop_tx.send(b"")
        self._thread.join(timeout=10)
        self._stop_tx.close(linger=0)
        self._stop_rx.close(linger=0)


def peer_problem(info, policy: str) -> str | None:
    """Why a decode with allocation policy `policy` cannot take requests from the prefill
    instance SGLang's bootstrap server described as `info` (None: it can)."""
    theirs = getattr(info, "decode_allocation_policy", "early")
    if theirs != policy:
        return (f"decode allocation policy mismatch: prefill {theirs}, decode {policy} "
                f"(set --disaggregation-decode-allocation-policy identically on both roles)")
    if policy == POLICY and (info.attn_tp_size != 1 or info.attn_cp_size != 1 or info.pp_size != 1):
        return (f"{POLICY} needs a prefill of attention TP 1, CP 1 and PP 1 (SGLang's rule), this one has "
                f"TP {info.attn_tp_size}, CP {info.attn_cp_size}, PP {info.pp_size}")
    return None


def prefill_rank(receiver) -> dict | None:
    """SGLang's bootstrap record of the receiver's prefill rank (rank_ip, rank_port), asked once per
    prefill instance and DP rank and kept on the manager; None if the bootstrap server has none."""
    mgr = receiver.kv_mgr
    key = (receiver.bootstrap_addr, int(receiver.prefill_dp_rank or 0))
    with mgr.connection_lock:
        info = mgr.connection_pool.get(("kvstage", *key))
    if info is None:
        info = receiver._get_bootstrap_info_from_server(key[1], 0, 0, 0)
        if info is None:
            return None
        with mgr.connection_lock:
            mgr.connection_pool[("kvstage", *key)] = info
    return info


def announce(receiver) -> str | None:
    """Step 1: the decode's endpoint for this room, sent to its prefill rank. Returns why it
    could not be sent (None: sent)."""
    info = prefill_rank(receiver)
    if info is None:
        return (f"SGLang's bootstrap server {receiver.bootstrap_addr} knows no prefill rank of DP rank "
                f"{receiver.prefill_dp_rank}")
    mgr = receiver.kv_mgr
    try:
        sock, lock = receiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart([b"BOOTSTRAP", str(receiver.bootstrap_room).encode("ascii"),
                                 mgr.local_ip.encode("ascii"), str(mgr.rank_port).encode("ascii")])
    except zmq.ZMQError as exc:
        return f"{POLICY}: could not reach prefill rank {info.get('rank_ip')}:{info.get('rank_port')}: {exc}"
    return None


def withdraw(receiver) -> None:
    """The decode ended the request before its metadata: SGLang's ABORT to the prefill rank, so its
    sender fails (best effort: a prefill that cannot be reached fails at its own timeout)."""
    from sglang.srt.disaggregation.common.conn import AbortNotification
    info = prefill_rank(receiver)
    if info is None:
        return
    mgr = receiver.kv_mgr
    try:
        sock, lock = receiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(AbortNotification(room=receiver.bootstrap_room, decode_ip=mgr.local_ip,
                                                  decode_port=mgr.rank_port, generation=None).to_zmq())
    except zmq.ZMQError as exc:
        log.warning("kvstage: could not tell prefill rank %s:%s that room %d was aborted: %s",
                    info.get("rank_ip"), info.get("rank_port"), receiver.bootstrap_room, exc)


def source_state(mgr, room: int, waited_s: float) -> tuple[int, str | None]:
    """What a decode receiver that announced `room` and sent no metadata yet polls: WaitingForInput
    once the prefill said its KV is computed, Failed (with the reason) when the prefill said it
    failed or after SGLang's waiting timeout, else Bootstrapping."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    status = mgr.request_status.get(room)
    if status == KVPoll.Failed:
        with mgr.failure_lock:
            reason = mgr.failure_records.get(room)
        return KVPoll.Failed, f"the prefill failed the request before it completed it: {reason or 'no reason given'}"
    if status == KVPoll.WaitingForInput:
        return KVPoll.WaitingForInput, None
    if waited_s >= mgr.waiting_timeout:
        return KVPoll.Failed, (f"timed out after {waited_s:.0f} s waiting for the prefill to compute the request "
                               f"({POLICY}; SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
    return KVPoll.Bootstrapping, None
