"""SGLang's scheduler-facing transfer classes for backend kvstage.

They subclass SGLang's Common* classes because SGLang's schedulers reach into them (the decode
side's prefill_info_table and try_ensure_parallel_info, conclude_state, abort_notified,
bootstrap_infos, query_prefill_dp_ranks; the prefill side's transfer_infos). SGLang's own
bootstrap server keeps doing what the schedulers ask of it (topology, DP-rank queries); every
byte of KV moves through one kvstage KVManager per rank, with kvstage's rendezvous server
running beside SGLang's bootstrap server in the same process.

Each class keeps SGLang's KVPoll contract: states only move forward, Success and Failed stick,
failure_exception() raises (a kvstage KVTransferError), get_transfer_metric() works after
clear().
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

import numpy as np
import requests
import torch
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs

from kvstage import EngineConfig, KVManager, KVTransferError
from kvstage.bootstrap.in_process import InProcessServer, join_host_port
from kvstage.transfer.config import METRICS_PORT_ENV

from . import pools, prefill_complete, send_gate
from .geometry import (
    cp_ranks_hold_copies,
    cp_stage,
    device_of,
    draft_equal_tp_only,
    dsa_tail_slot_bytes,
    kv_layout,
    kv_memory_device,
    unsupported_features,
)
from .plugin import engine_options
from .rendezvous import address_from_route, instance_address, route_answer, shared_rendezvous
from .state import StateMap

log = logging.getLogger("kvstage.sglang")

RENDEZVOUS_ROUTE = "/kvstage/rendezvous"
BACKEND_ENV = "KVSTAGE_SGLANG_BACKEND"          # nixl (default) or mooncake
AUX_GATE_S = 5.0                               # how long Success may wait for the aux row's room


class KvstageKVManager(CommonKVManager):
    """One rank's kvstage engine, created from SGLang's KVArgs (raw pointers, no copy)."""

    # SGLang's deferred decode KV release: a failed request's pages and aux slot stay held until
    # is_abort_release_safe() below says that kvstage knows no write of it can still land
    supports_deferred_decode_kv_release = True
    # SGLang's PD role switch (--enable-pd-role-switch): on an idle instance it calls teardown(),
    # then builds the other role's manager over the same KV pool; teardown() below lets go of
    # everything this manager holds (tests/sglang_adapter/test_role_switch.py)
    supports_role_switch = True
    # SGLang's status messages (prefill_complete.py) carry the prefill's failure reason
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: ServerArgs,
                 is_mla_backend: bool | None = False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        problems = unsupported_features(self, args)
        if problems:
            raise NotImplementedError("the kvstage transfer backend does not support " + "; ".join(problems))
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.page_size = args.page_size
        self._rendezvous: dict[str, str] = {}
        self._rendezvous_lock = threading.Lock()
        self._own_server: InProcessServer | None = None
        self.receivers: dict[int, object] = {}      # decode: room -> its kvstage receiver, until clear()
        # prefill CP where CP rank 0 sends (geometry.cp_problems): the other CP ranks hold the same
        # KV and move nothing, as SGLang's own dummy CP ranks; they run no kvstage engine, and their
        # senders succeed at their last send (KvstageKVSender)
        # (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER splits SGLang's sending, not the KV: every CP
        # rank holds it whole, and CP rank 0 moves it as without the variable, cp_ranks_hold_copies)
        self.dummy_cp_rank = self.is_prefill and (bool(getattr(self, "is_dummy_cp_rank", False)) or (
            cp_ranks_hold_copies(self) and self.attn_cp_rank != 0))
        if self.dummy_cp_rank:
            self.engine: KVManager | None = None
            self.host_engine: KVManager | None = None
            self.gate = None
            self.bootstrap_channel = None
            log.info("kvstage prefill CP rank %d of %d (attention TP rank %d): CP rank 0 moves the KV, this rank "
                     "runs no kvstage engine", self.attn_cp_rank, self.attn_cp_size, self.attn_tp_rank)
            return
        # a hybrid model's full-attention pool may be MLA although its pool as a whole is not
        mla = bool(is_mla_backend) or bool(getattr(args, "is_hybrid_mla_backend", False))
        # decode context parallel: SGLang's attention DCP size (its DCP rank is tp_rank % size, as
        # kvstage's); unsupported_features refused every shape kvstage does not serve
        # PP, or under DSA cache layer split the CP ranks as stages of their own layers (cp_stage)
        pp_size, pp_rank = cp_stage(self)
        layout = kv_layout(args, self.attn_tp_size, self.attn_tp_rank, mla, server_args,
                           pp_size=pp_size, pp_rank=pp_rank, decode=not self.is_prefill,
                           dcp_size=int(self.dcp_size or 1),
                           page_shards=int(getattr(self, "kv_shard_size", 1) or 1) if self.is_prefill else 1)
        self.kv_dcp_size = layout.dcp_size
        device = device_of(server_args, args)
        self.kv_device = torch.device(device)
        self.draft_equal_tp_only = draft_equal_tp_only(args, mla, server_args)
        self.state = StateMap(args, layout, self.kv_device, self.attn_tp_size,
                              dsa_tail_slot_bytes=dsa_tail_slot_bytes(args, server_args))
        # HiSparse: the KV SGLang hands over is its host pool (DRAM), the rest stays on the device
        buffers = pools.make_buffers(layout, args, kv_memory_device(server_args, args), self.state.pools)
        self.aux_rooms = pools.aux_room_column(args, device)
        if self.is_prefill:
            own = self._own_bootstrap_addr()
            rendezvous = self.rendezvous_for(own, wait_s=60.0)
            dp_rank = self.attn_dp_rank if self.attn_dp_size > 1 else self.system_dp_rank
            engine_id = f"sglang-prefill@{own}/dp{dp_rank}"
        else:
            # a decode rank registers at a rendezvous server of its own (with
            # KVSTAGE_BOOTSTRAP=etcd://..., in the fleet's namespace); it reaches prefill engines at
            # theirs (kvstage looks them up there by rendezvous address + DP rank)
            rendezvous, dp_rank = shared_rendezvous(), 0
            if rendezvous is None:
                self._own_server = InProcessServer(self.local_ip)
                rendezvous = self._own_server.address
            engine_id = f"sglang-decode@{self.local_ip}:{server_args.port}/dp{self.attn_dp_rank}"
        backend = _backend_name()
        # SGLang's staging switch and ring size are mapped here (plugin.engine_options); the core
        # reads only KVSTAGE_* variables
        config = EngineConfig(role="prefill" if self.is_prefill else "decode", engine_id=engine_id,
                              bootstrap=rendezvous, backend=backend, host=self.local_ip, dp_rank=dp_rank,
                              **engine_options())
        self.engine = KVManager(config, layout, buffers)
        # decode: host KV destinations (--disaggregation-decode-host-receive-threshold below 1).
        # SGLang's host pool has the device KV's layout; kvstage sees it as a second cache, in
        # DRAM, behind an engine of its own: a request sent to it is a request like any other
        # (staged or direct, by that engine's own path choice), written into host memory.
        self.host_engine = None
        if not self.is_prefill and getattr(args, "host_kv_data_ptrs", None):
            host_buffers = pools.make_buffers(layout, pools.host_kv_args(args), "cpu", self.state.pools)
            # its own ports: a fixed KVSTAGE_CTRL_PORT or KVSTAGE_METRICS_PORT belongs to the device engine
            self.host_engine = KVManager(replace(config, engine_id=engine_id + "/host", ctrl_port=0,
                                                 metrics_port=0 if os.environ.get(METRICS_PORT_ENV) else None),
                                         layout, host_buffers)
        # prefill: the thread that waits for SGLang's events before a send (send_gate.py)
        self.gate = send_gate.SendGate() if self.is_prefill else None
        log.info("kvstage %s rank %d/%d ready (engine %s, backend %s, staging %s, metrics port %s)",
                 self.engine.config.role, layout.rank, layout.ranks, engine_id, backend,
                 self.engine.config.staging, self.engine.metrics_port)
        if not self.is_prefill:
            _check_release_timeout(self.enable_deferred_decode_kv_release, self.engine.config.timeouts)
        # SGLang's prefill_complete allocation policy: its bootstrap and status messages on this
        # manager's socket (prefill_complete.py)
        self.bootstrap_channel = (prefill_complete.BootstrapChannel(self, prefill=self.is_prefill)
                                  if self.defer_decode_allocation else None)

    def _own_bootstrap_addr(self) -> str:
        """Where this prefill instance's SGLang bootstrap server is reached (as SGLang's own
        registration computes it)."""
        if self.dist_init_addr:
            host = self.dist_init_addr.rsplit(":", 1)[0].strip("[]")
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        return join_host_port(host, self.bootstrap_port)

    def rendezvous_for(self, bootstrap_addr: str, wait_s: float = 5.0) -> str:
        """kvstage's rendezvous address of the prefill instance whose SGLang bootstrap server is
        `bootstrap_addr` (asked once over HTTP, cached). Raises RuntimeError past `wait_s`."""
        with self._rendezvous_lock:
            cached = self._rendezvous.get(bootstrap_addr)
        if cached is not None:
            return cached
        deadline = time.monotonic() + wait_s
        while True:
            try:
                reply = requests.get(f"http://{bootstrap_addr}{RENDEZVOUS_ROUTE}", timeout=5)
                if reply.status_code == 200:
                    addr = address_from_route(bootstrap_addr, reply.json())   # a server's port, or etcd
                    break
                error = f"HTTP {reply.status_code}: {reply.text[:200]}"
            except (requests.RequestException, ValueError, KeyError) as exc:
                error = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no kvstage rendezvous server behind the SGLang bootstrap server "
                                   f"{bootstrap_addr} (is its backend kvstage?): {error}")
            time.sleep(0.2)
        with self._rendezvous_lock:
            self._rendezvous[bootstrap_addr] = addr
        return addr

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether SGLang may hand a failed request's pages and aux slot to another request: once
        kvstage's receiver is `released` (every prefill writer of the room quiesced after its
        last write completed, or was declared lost and its backend's stall bound passed). SGLang's
        count of prefill acks (`required_acks`) does not apply: the kvstage room waits for each
        writer itself. No receiver: nothing was ever asked of a prefill rank."""
        handle = self.receivers.get(bootstrap_room)
        return handle is None or handle.released

    def fail_room(self, room: int, reason: str) -> None:
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    @property
    def supports_host_destination(self) -> bool:
        """SGLang's question before it turns host receive on: only with its host buffers given."""
        return self.host_engine is not None

    def engine_for(self, destination) -> KVManager:
        """The kvstage engine of a destination: the device cache's, or the host pool's."""
        if destination == KVTransferDestination.HOST:
            if self.host_engine is None:
                raise ValueError("a host KV destination, but SGLang gave no host KV buffers (host_kv_data_ptrs)")
            return self.host_engine
        return self.engine

    def teardown(self) -> None:
        """Everything this manager holds, let go (at the server's end, and before SGLang's PD
        role switch builds the other role's manager over the same KV pool): the send gate, the
        kvstage engines (their threads, backend registrations and rendezvous records), a
        decode's own rendezvous server, the thread reading SGLang's bootstrap messages
        (prefill_complete), and the socket SGLang's CommonKVManager bound."""
        if self.gate is not None:
            self.gate.close()
        if self.bootstrap_channel is not None:
            self.bootstrap_channel.close()
        if self.engine is not None:
            self.engine.close()
        if self.host_engine is not None:
            self.host_engine.close()
        if self._own_server is not None:
            self._own_server.close()
        self.receivers.clear()
        self.server_socket.close(linger=0)
        self._zmq_ctx.destroy(linger=0)


def _check_release_timeout(enabled: bool, timeouts) -> None:
    """SGLang frees held pages at its deferred-release timeout even if no drain was confirmed;
    kvstage's release can take up to a write deadline plus a lease (a writer lost mid-write)."""
    from sglang.srt.environ import envs
    limit = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
    if not enabled:
        log.warning("SGLang's deferred decode KV release is off (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE): "
                    "the pages of a failed request are reused at once, while a kvstage write may still land in "
                    "them (docs/sglang.md)")
    elif limit < timeouts.write + timeouts.lease:
        log.warning("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=%g is below kvstage's write deadline "
                    "plus lease (%g s): a failed request's pages may be reused before kvstage released them",
                    limit, timeouts.write + timeouts.lease)


def _backend_name() -> str:
    name = os.environ.get(BACKEND_ENV, "nixl").strip().lower()
    if name not in ("nixl", "mooncake"):
        raise ValueError(f"{BACKEND_ENV} must be nixl or mooncake, got {name!r}")
    return name


class _Handle:
    """What sender and receiver share: the kvstage handle, terminal-state bookkeeping, metrics.

    `request_tokens`: the request's token count, which SGLang's sender and receiver interfaces
    do not carry; the plugin's hooks on SGLang's queues set it from the request before the
    sender's init() and the receiver's send_metadata() (plugin.tell_prefill_tokens,
    plugin.tell_decode_tokens). kvstage needs it when the decode side has decode context
    parallel (a rank's last page is partly filled); None: not known."""

    kv_mgr: KvstageKVManager
    bootstrap_room: int
    conclude_state: KVPoll | None
    request_tokens: int | None = None

    def _end(self, state: int, reason: str | None = None) -> int:
        if state == KVPoll.Failed and reason is not None:
            self.kv_mgr.record_failure(self.bootstrap_room, reason)
            if getattr(self, "_error", None) is None:   # the adapter's own reason, not the abort's
                self._error = KVTransferError(self.bootstrap_room, "sglang", reason)
        self.conclude_state = state
        self.kv_mgr.request_status[self.bootstrap_room] = state
        return state

    def _kv_state(self) -> int:
        """The kvstage handle's state, failures recorded with their kind and reason."""
        state = int(self._handle.poll())
        if state == KVPoll.Failed:
            self._error = self._handle.failure_exception()
            return self._end(KVPoll.Failed, str(self._error) if self._error else "failed")
        return state

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        error = self._error
        if error is None and self._handle is not None:
            error = self._handle.failure_exception()
        with self.kv_mgr.failure_lock:
            reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        self._after_failure()
        if error is None:
            error = KVTransferError(self.bootstrap_room, "sglang", reason or "failed for an unknown reason")
        raise error

    def get_transfer_metric(self) -> KVTransferMetric:
        metric = KVTransferMetric()
        m = self._handle.metrics() if self._handle is not None else None
        if m is not None:
            metric.transfer_latency_s = self._latency(m)
            metric.transfer_total_bytes = m.nbytes
        return metric

    def _latency(self, m) -> float | None:
        return m.seconds

    def _after_failure(self) -> None:
        self.clear()

    def _clear_handle(self) -> None:
        if self._handle is not None:
            self._handle.clear()
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)


class KvstageKVSender(_Handle, CommonKVSender):
    """Prefill side of one request. SGLang gives the page count of what it sends (the pages
    past the decode prefix) and sends without a last flag; kvstage counts the whole request,
    so the prefix pages are prepended to the first send (kvstage skips them).

    On a dummy CP rank (a prefill CP rank other than 0, KvstageKVManager.dummy_cp_rank) it moves
    nothing: WaitingForInput at once, Success once SGLang sent every page it announced (at once
    when it announced none), Failed when aborted; CP rank 0 moves the request's KV."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        CommonKVSender.__init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._handle, self._error = None, None
        self._prefix_pages, self._first = 0, True
        # SGLang names a request's state only with its last send: the aux row goes with init(),
        # the state items with kvstage's last send, and the KV streams chunk by chunk meanwhile
        self._sent, self._last_send_at = 0, None
        self._awaiting_mark = False             # prefill_complete: the kvstage sender not made yet
        self._sends = send_gate.RequestSends(mgr.gate, self._send_now, self._abort_handle)
        # with a CUDA cache SGLang may hand the page indices as a pinned host tensor that its
        # copy is still filling (indices_event): the gate waits, the scheduler does not copy
        self.supports_host_tensor_indices = mgr.gate is not None and mgr.kv_device.type == "cuda"
        self._dummy = mgr.dummy_cp_rank
        if self._dummy:
            return
        if self.conclude_state is not None or mgr.request_status.get(bootstrap_room) == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed
            return
        # prefill_complete: the kvstage sender is made when the prefill completes the request
        # (mark_prefill_complete), so kvstage's metadata deadline counts from there, not from the
        # prefill's queue and compute before it (the decode sends no metadata until then)
        self._awaiting_mark = mgr.deferred_bootstrap is not None
        if not self._awaiting_mark:
            self._make_handle()

    def _make_handle(self) -> None:
        try:
            self._handle = self.kv_mgr.engine.sender(self.bootstrap_room)
        except (ValueError, RuntimeError) as exc:
            self._end(KVPoll.Failed, f"kvstage refused room {self.bootstrap_room}: {exc}")

    def mark_prefill_complete(self) -> None:
        """prefill_complete: the request is computed. The kvstage sender is made, then SGLang's
        own step tells a decode that announced the room (prefill_complete.py)."""
        if self._awaiting_mark and self.conclude_state is None:
            self._awaiting_mark = False
            self._make_handle()
        if self.conclude_state is None:
            CommonKVSender.mark_prefill_complete(self)

    def pop_decode_prefix_len(self) -> int:
        """The prefix SGLang leaves out of its sends: what kvstage knows of the decode side's
        now (0 before its metadata came: a PP stage past the first may be told to start by PP
        rank 0's poll first). init() counts exactly this many stand-in pages, whatever arrives
        in between. In tokens: pages of page_size x dcp_size tokens on a prefill with decode
        context parallel (its allocator's pages, each one local page of every DCP rank)."""
        pages = self._handle.decode_prefix_pages if self._handle is not None else None
        self._prefix_pages = pages or 0
        return self._prefix_pages * self.kv_mgr.page_size * getattr(self.kv_mgr, "kv_dcp_size", 1)

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        """`num_kv_indices`: the pages SGLang will send, past the prefix pop_decode_prefix_len()
        gave it (none popped: SGLang sends every page)."""
        self.num_kv_indices, self.aux_index = num_kv_indices, aux_index
        if self._awaiting_mark and self.conclude_state is None:
            # SGLang marks a request complete before its init(); should it not, the sender is made here
            self._awaiting_mark = False
            self._make_handle()
        if self._dummy and self.conclude_state is None and num_kv_indices <= 0:
            self._end(KVPoll.Success)
        if self._handle is None or self.conclude_state is not None:
            return
        self._fail_now(self._init_handle(None))

    def _init_handle(self, state_indices) -> str | None:
        try:
            self._handle.init(self.num_kv_indices + self._prefix_pages, num_tokens=self.request_tokens,
                              **pools.init_items(self.kv_mgr, self.aux_index, state_indices))
        except (ValueError, RuntimeError) as exc:
            return f"init: {exc}"
        return None

    def _fail_now(self, failure: str | None) -> None:
        if failure is not None:
            self._handle.abort()
            self._end(KVPoll.Failed, failure)

    def _end(self, state: int, reason: str | None = None) -> int:
        """As _Handle's; under SGLang's prefill_complete policy a failure is also told to a decode
        that announced the room and may still wait for the prefill to compute it (SGLang's
        status channel; once the decode sent its metadata kvstage's own abort tells it)."""
        mgr = self.kv_mgr
        if state == KVPoll.Failed and mgr.deferred_bootstrap is not None and self._owns_bootstrap_room:
            mgr._notify_bootstrap(self.bootstrap_room, mgr.deferred_bootstrap.fail(self.bootstrap_room))
        return super()._end(state, reason)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    def send(self, kv_indices, state_indices: list | None = None, num_kv_tokens: int | None = None,
             indices_event: object | None = None):
        """SGLang's events (the overlap schedule's `_early_send_wait_event`, `indices_event`
        with host tensor indices) are waited on by the adapter's send gate before the indices
        or the pages are read, never on the scheduler's thread (send_gate.py)."""
        events = [e for e in (self._early_send_wait_event, indices_event) if e is not None]
        self._early_send_wait_event = None      # it belongs to this chunk only
        if self._dummy and self.conclude_state is None:   # CP rank 0 sends these pages
            self._sent += int(np.asarray(kv_indices).size)
            if self._sent >= self.num_kv_indices:
                self._end(KVPoll.Success)
            return
        if self.conclude_state is not None or self._handle is None:
            return
        self._fail_now(self._sends.send(kv_indices, state_indices, events))

    def _send_now(self, kv_indices, state_indices) -> str | None:
        """The send proper: on the scheduler's thread, or on the gate's once its events are
        complete. Returns a failure reason (the caller aborts and ends the request)."""
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return None
        if self._first and self._prefix_pages:
            # stand-ins for the pages the decode side holds: kvstage skips them, never reads them
            pages = np.concatenate([np.full(self._prefix_pages, pages[0], dtype=np.int64), pages])
        self._first = False
        last = self._sent + pages.size == self.num_kv_indices + self._prefix_pages
        try:
            items = self.kv_mgr.state.items(state_indices) if last and self.kv_mgr.state.pools else {}
            if items:   # the decode's prefix beyond the one popped: SGLang named its DSA pages too
                known = self._handle.decode_prefix_pages or 0
                items = self.kv_mgr.state.past_prefix(items, known - self._prefix_pages)
            self._handle.send(pages, pool_items=items or None)
        except (ValueError, RuntimeError) as exc:
            return f"send: {exc}"
        self._sent += pages.size
        if self._sent == self.num_kv_indices + self._prefix_pages:
            self._last_send_at = time.monotonic()
        self._record_transfer_indices(kv_indices, state_indices)
        return None

    def _latency(self, m) -> float | None:
        """From the last send (the prefill computed all of the request) to the end, as SGLang
        measures other backends, rather than kvstage's from init(), before the first chunk."""
        if self._last_send_at is None or m.timeline.ended is None:
            return m.seconds
        return max(0.0, m.timeline.ended - self._last_send_at)

    def _abort_handle(self) -> None:
        if self._handle is not None:
            self._handle.abort()

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._dummy:
            return KVPoll.WaitingForInput
        mgr = self.kv_mgr
        if mgr.deferred_bootstrap is not None and mgr.request_status.get(self.bootstrap_room) == KVPoll.Failed:
            # prefill_complete: the decode's ABORT came before its metadata (BootstrapChannel)
            if self._handle is not None:
                self._handle.abort()
            return self._end(KVPoll.Failed, f"the decode side aborted room {self.bootstrap_room} before it sent its "
                                            f"metadata ({prefill_complete.POLICY})")
        if self._handle is None:
            # prefill_complete: not completed yet (mark_prefill_complete makes the kvstage sender)
            return KVPoll.Bootstrapping if self._awaiting_mark else self._end(KVPoll.Failed)
        if self._sends.failure is not None:     # a send on the gate's thread failed
            return self._end(KVPoll.Failed, self._sends.failure)
        state = self._kv_state()
        if state == KVPoll.Success:
            return self._end(KVPoll.Success)
        return state

    poll_pp_consensus = poll

    def abort(self):
        self._sends.cancel()
        if self._handle is not None:
            self._handle.abort()
        if self.conclude_state != KVPoll.Success:
            self._end(KVPoll.Failed, "Aborted by AbortReq.")

    def clear(self) -> None:
        self._sends.cancel()
        mgr = self.kv_mgr
        if mgr.deferred_bootstrap is not None and self._owns_bootstrap_room:
            # prefill_complete: the room leaves SGLang's table; a decode still waiting for it is
            # told it failed, unless the request succeeded (kvstage told the decode that itself)
            told = mgr.deferred_bootstrap.close(self.bootstrap_room, self,
                                                success=self.conclude_state == KVPoll.Success)
            self._owns_bootstrap_room = False
            if told is not None and told[1]:
                mgr._notify_bootstrap(self.bootstrap_room, told)
        self._clear_handle()
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)
        self.kv_mgr.transfer_infos.pop(self.bootstrap_room, None)


class KvstageKVReceiver(_Handle, CommonKVReceiver):
    """Decode side of one request. Success is held until the aux row's bootstrap_room column
    names this request (SGLang reads the first output token from that row)."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int | None = None):
        CommonKVReceiver.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self._handle, self._error = None, None
        self._rendezvous: str | None = None
        self._aux_index: int | None = None
        self._kv_done_at: float | None = None
        self.bootstrap_infos = None
        # prefill_complete: when this receiver announced its room to the prefill (its metadata
        # waits for the prefill's WaitingForInput); None: not waiting (prefill_complete.py)
        self._announced_at: float | None = None

    def init(self, prefill_dp_rank: int):
        if self.conclude_state is not None:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            self._end(KVPoll.Failed, f"prefill server at {self.bootstrap_addr} is not known (or went down)")
            return
        self.prefill_info, self.prefill_dp_rank = info, prefill_dp_rank
        self.require_staging = False          # SGLang's own staging machinery stays off
        policy = prefill_complete.POLICY if self.kv_mgr.defer_decode_allocation else "early"
        problem = prefill_complete.peer_problem(info, policy)
        if problem is not None:
            self._end(KVPoll.Failed, problem)
            return
        try:
            self._rendezvous = self.kv_mgr.rendezvous_for(self.bootstrap_addr)
        except (ValueError, RuntimeError) as exc:
            self._end(KVPoll.Failed, f"kvstage receiver for room {self.bootstrap_room}: {exc}")
            return
        self.bootstrap_infos = []             # kvstage owns the peer connections
        if self.kv_mgr.host_engine is None:   # one destination: the receiver starts now
            self._open(KVTransferDestination.DEVICE)
        if self.kv_mgr.defer_decode_allocation and self._handle is not None:
            failure = prefill_complete.announce(self)
            if failure is not None:
                self._handle.abort()
                self._end(KVPoll.Failed, failure)
                return
            self._announced_at = time.time()

    def _open(self, destination) -> bool:
        """The kvstage receiver of the room, on the engine of `destination`. With host KV
        destinations the destination is known only at send_metadata(), so it is made there."""
        try:
            self._handle = self.kv_mgr.engine_for(destination).receiver(
                self.bootstrap_room, bootstrap=self._rendezvous, prefill_dp_rank=int(self.prefill_dp_rank or 0))
        except (ValueError, RuntimeError) as exc:
            self._end(KVPoll.Failed, f"kvstage receiver for room {self.bootstrap_room}: {exc}")
            return False
        self.kv_mgr.receivers[self.bootstrap_room] = self._handle
        return True

    @property
    def supports_host_destination(self) -> bool:
        return self.kv_mgr.host_engine is not None

    def send_metadata(self, kv_indices, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices=None):
        """`destination` HOST: `kv_indices` are pages of SGLang's host pool (host KV destinations)."""
        if self.conclude_state is not None:
            return
        self._announced_at = None             # prefill_complete: no longer waiting for the prefill
        if self._handle is None:
            if self._rendezvous is None or not self._open(destination):
                return
        elif destination != KVTransferDestination.DEVICE:   # the device receiver started at init()
            self._handle.abort()
            self._end(KVPoll.Failed, "a host KV destination, but this manager has no host KV buffers")
            return
        prefix = int(decode_prefix_len or 0)
        # decode context parallel: SGLang's page indices here are its virtual pages of page_size x
        # dcp_size tokens (its allocator's page), each one page of this rank's own tokens: what
        # kvstage takes as this rank's local pages; the prefix is whole virtual pages
        dcp = self.kv_mgr.kv_dcp_size
        unit = self.kv_mgr.page_size * dcp
        problem = None
        if prefix % unit:
            problem = (f"decode_prefix_len {prefix} is not a whole number of {unit}-token pages"
                       + (f" (page_size {self.kv_mgr.page_size} x decode context parallel {dcp})" if dcp > 1 else ""))
        elif dcp > 1 and self.request_tokens is None:
            problem = (f"decode context parallel (dcp_size {dcp}) needs the request's token count, which SGLang's "
                       f"decode queue did not give (kvstage's plugin hook on DecodePreallocQueue._send_kv_metadata)")
        elif self.kv_mgr.draft_equal_tp_only and int(self.prefill_info.attn_tp_size) != self.kv_mgr.attn_tp_size:
            problem = (f"the kvstage backend moves {self.kv_mgr.draft_equal_tp_only} between equal attention TP "
                       f"sizes only (prefill TP {self.prefill_info.attn_tp_size}, decode TP {self.kv_mgr.attn_tp_size})")
        elif state_indices:
            problem = self.kv_mgr.state.peer_problem(int(self.prefill_info.attn_tp_size), self.kv_mgr.attn_tp_size)
        if problem:
            self._handle.abort()
            self._end(KVPoll.Failed, problem)
            return
        self._aux_index = aux_index
        try:
            self._handle.init(np.asarray(kv_indices, dtype=np.int64).reshape(-1), prefix_pages=prefix // unit,
                              num_tokens=self.request_tokens if dcp > 1 else None,
                              **pools.init_items(self.kv_mgr, aux_index, state_indices))
        except (ValueError, RuntimeError) as exc:
            self._handle.abort()
            self._end(KVPoll.Failed, f"send_metadata: {exc}")
            return
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._handle is None:
            # with host KV destinations the receiver is made by send_metadata(), once SGLang
            # chose the destination: ready for it as soon as the prefill's rendezvous is known
            return KVPoll.WaitingForInput if self._rendezvous is not None else KVPoll.Bootstrapping
        state = self._kv_state()
        if self._announced_at is not None:   # prefill_complete, before the metadata
            if state == KVPoll.Failed:
                self._withdraw()
                return state
            return self._wait_for_prefill()
        if state != KVPoll.Success:
            return state
        # the aux row must name this request before SGLang reads it
        if pools.aux_row_ready(self.kv_mgr, self._aux_index, self.bootstrap_room):
            return self._end(KVPoll.Success)
        now = time.monotonic()
        self._kv_done_at = self._kv_done_at or now
        if now - self._kv_done_at > AUX_GATE_S:
            return self._end(KVPoll.Failed, f"room {self.bootstrap_room}: the KV landed but aux row "
                                            f"{self._aux_index} does not name this request")
        return KVPoll.Transferring

    def _wait_for_prefill(self) -> int:
        """prefill_complete, before the metadata: the prefill's word on its KV (its status
        messages, BootstrapChannel), or SGLang's waiting timeout."""
        waited = time.time() - self._announced_at
        state, reason = prefill_complete.source_state(self.kv_mgr, self.bootstrap_room, waited)
        if state == KVPoll.Failed:
            self._withdraw()
            self._handle.abort()
            return self._end(KVPoll.Failed, reason)
        return state

    def _withdraw(self) -> None:
        """prefill_complete: a room announced and ended before its metadata is withdrawn at the
        prefill (SGLang's ABORT), whose sender would otherwise wait for metadata that never comes."""
        if self._announced_at is not None:
            self._announced_at = None
            prefill_complete.withdraw(self)

    def abort(self):
        self._withdraw()
        if self._handle is not None:
            self._handle.abort()
        if self.conclude_state != KVPoll.Success:
            self._end(KVPoll.Failed, "Aborted by AbortReq.")
        self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang calls this for a failure the decode side did not start (a prefill rank's
        failure, a transport error) before it holds the request's pages. kvstage's abort reaches
        every prefill rank of the room (those the failure did not come from are told, and told
        again until each one quiesced); on a room that already failed it changes nothing."""
        self._withdraw()
        if not self.abort_notified and self._handle is not None:
            self._handle.abort()
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        return self._handle is None or self._handle.released

    def _after_failure(self) -> None:
        # SGLang may hold the request's pages until is_abort_release_safe(): the kvstage handle
        # stays until clear(), which SGLang calls when it releases them
        self._forget_room()

    def _forget_room(self) -> None:
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.required_prefill_response_num_table.pop(self.bootstrap_room, None)
        self.kv_mgr.prefill_response_tracker.pop(self.bootstrap_room, None)
        self.kv_mgr.addr_to_rooms_tracker[self.bootstrap_addr].discard(self.bootstrap_room)

    def clear(self) -> None:
        self._withdraw()
        self._clear_handle()
        if self._handle is not None and self.kv_mgr.receivers.get(self.bootstrap_room) is self._handle:
            del self.kv_mgr.receivers[self.bootstrap_room]
        self._forget_room()


class KvstageKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server of a prefill instance, plus kvstage's rendezvous server on a
    free port; `GET /kvstage/rendezvous` tells ranks that port. With KVSTAGE_BOOTSTRAP=etcd://...
    no server: the route names the instance's own namespace in that etcd (rendezvous.py)."""

    def __init__(self, host: str, port: int):
        bind = host or "127.0.0.1"
        fleet = shared_rendezvous()
        self._etcd = instance_address(fleet) if fleet is not None else None
        self._kvstage = InProcessServer(bind) if fleet is None else None
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_get(RENDEZVOUS_ROUTE, self._handle_kvstage_rendezvous)

    async def _handle_kvstage_rendezvous(self, request: web.Request):
        return web.json_response(route_answer(self._kvstage.port if self._kvstage else None, self._etcd))

    def close(self):
        if self._kvstage is not None:
            self._kvstage.close()
        super().close()
