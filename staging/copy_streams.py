"""The CUDA stream a kvstage thread queues its gathers and scatters on.

On a GPU every copy kvstage makes (a transfer worker's gather into its staging buffer, the
scatter of a landed piece, a small piece gathered or scattered inline by the control thread, a
page list's upload) goes on the calling thread's CURRENT stream, and every job waits for that
stream before it hands its bytes on: a transfer worker before it posts the piece's write, the
scatter worker before it reports the piece scattered, an upload before its index is shared. That
wait is what makes the bytes safe to hand on, and it must cover the job's own copies only.

A thread that never sets its stream has the device's legacy default stream as its current one. Every
thread of the process that did not set one shares it, and CUDA orders it against every other
blocking stream of the process (work queued on it waits for theirs, and theirs for it). A wait for
it then also waits for the other workers' copies and for whatever a library queued on a blocking
stream; and in a serving engine whose forward pass runs on that stream (or on a blocking one), a
gather or scatter queued there waits behind the next batch's forward pass. So with
`EngineConfig(copy_streams=True)` (the default; env `KVSTAGE_COPY_STREAMS`), each thread that copies
makes a non-blocking stream of its own (from PyTorch's stream pool) its current stream once, before
its first copy: `use_own_stream`. That covers the transfer workers, the scatter worker and, for
inline pieces, the control thread (a kvstage thread, so its current stream is kvstage's to set).

What orders the copies against the caller's own GPU work is unchanged: a layer-wise send's
`ready` event is waited for on the host before its gather, a `send()` without one names pages
whose KV is already written (as the direct path, which the backend reads directly, needs too),
and the decode caller reads its cache after `Success`.

On the CPU (and with the option off) nothing changes: the device is data, the function returns.
"""

from __future__ import annotations

import torch

__all__ = ["use_own_stream"]


def use_own_stream(device: torch.device, enabled: bool) -> bool:
    """Make a non-blocking stream of `device` the calling thread's current stream, when `device`
    is a CUDA device and `enabled`; return whether it did. Called once per thread, on that
    thread, before its first copy (PyTorch's current stream is per thread)."""
    if not enabled or device.type != "cuda":
        return False
    torch.cuda.set_stream(torch.cuda.Stream(device))  # type: ignore[no-untyped-call]  # torch leaves Stream() unannotated
    return True
