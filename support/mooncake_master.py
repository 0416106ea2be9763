"""A real Mooncake Store master for the storage tests and examples/bench_storage.py: the Mooncake package's mooncake_master
with its HTTP metadata server, on free ports, stopped by its PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvstage.support.cluster import free_port


@contextlib.contextmanager
def mooncake_master(logdir: Path):
    """Yields (master RPC address, metadata URL)."""
    binary = Path(sys.executable).parent / "mooncake_master"
    assert binary.exists(), f"{binary} missing: the Mooncake package provides it"
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = logdir / "master.log"
    p = subprocess.Popen([str(binary), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                          "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={http}",
                          f"-metrics_port={metrics}"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        for port in (rpc, http):
            while True:
                assert p.poll() is None, f"mooncake_master exited:\n{log.read_text()[-2000:]}"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"mooncake_master never listened on {port}"
                    time.sleep(0.1)
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
