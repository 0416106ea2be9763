"""Command line: ``python -m kvstage.bootstrap [serve] ...`` runs the server; ``... status`` asks one
(``--addr etcd://...``: the ranks an etcd rendezvous holds, as the same table).

serve: the first line on stdout is ``kvstage-bootstrap listening on tcp://HOST:PORT`` (the real
port, also with --port 0); logs go to stderr. SIGTERM or SIGINT stops it: exit code 0.
status: prints a table of the engines and ranks the server knows. Exit codes: 0 ok, 1 the
server refused or failed, 3 unreachable (no answer in time), 4 auth refused; 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

import zmq

from ..wire import TOKEN_ENV, load_token
from .client import BootstrapAuthError, BootstrapError, BootstrapTimeout
from .registry import Limits
from .rendezvous import open_rendezvous
from .server import BootstrapServer

log = logging.getLogger("kvstage.bootstrap")

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH = 1, 2, 3, 4


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvstage.bootstrap [serve]",
        description="kvstage bootstrap (rendezvous) server. "
                    "Also: 'python -m kvstage.bootstrap status --addr HOST:PORT'.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8998, help="port; 0 picks a free one (default 8998)")
    p.add_argument("--token-file", help=f"shared secret file (first line); else ${TOKEN_ENV}")
    p.add_argument("--lease-s", type=float, default=10.0,
                   help="a rank without heartbeat for this long is stale (default 10)")
    p.add_argument("--forget-s", type=float, default=None,
                   help="a rank is removed after this long without heartbeat "
                        "(default 6 x lease)")
    p.add_argument("--max-engines", type=int, default=Limits.max_engines)
    p.add_argument("--max-ranks-per-engine", type=int, default=Limits.max_ranks_per_engine)
    p.add_argument("--max-ranks", type=int, default=Limits.max_ranks, help="over all engines")
    p.add_argument("--log-level", default="INFO")
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstage.bootstrap status",
                                description="Print the engines and ranks a bootstrap server (or etcd) knows.")
    p.add_argument("--addr", default="127.0.0.1:8998",
                   help="HOST:PORT of a bootstrap server, or etcd://HOST:PORT[,...][/NAMESPACE] (default 127.0.0.1:8998)")
    p.add_argument("--token-file", help=f"shared secret file (first line); else ${TOKEN_ENV}")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    return p


def serve(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum, _frame):  # only flag it: logging here could re-enter a handler
        got.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        token = load_token(token_file=args.token_file)
        limits = Limits(args.max_engines, args.max_ranks_per_engine, args.max_ranks)
        server = BootstrapServer(args.host, args.port, token=token, lease_s=args.lease_s,
                                 forget_s=args.forget_s, limits=limits)
    except (OSError, ValueError) as exc:
        log.error("bad configuration: %s", exc)
        return EXIT_USAGE
    try:
        ep = server.start()
    except zmq.ZMQError as exc:
        log.error("cannot bind %s:%s: %s", args.host, args.port, exc)
        return EXIT_ERROR
    print(f"kvstage-bootstrap listening on {ep}", flush=True)
    log.info("serving on %s (lease %.1fs, %s)", ep, args.lease_s, limits)
    if token is None:
        log.warning("auth is OFF: anyone who can reach %s can register and look up ranks "
                    "(set %s or --token-file)", ep, TOKEN_ENV)
    try:
        server.serve(stop)
    finally:
        server.close()
    log.info("stopped%s", f" ({signal.Signals(got[0]).name})" if got else "")
    return 0


def _table(st: dict, addr: str) -> str:
    rows = st["ranks"]
    engines = {r["engine_id"] for r in rows}
    auth = f"auth {'on' if st['auth'] else 'off'}, {len(engines)} engines, {len(rows)} ranks"
    if st.get("rendezvous") == "etcd":   # AGE: since the rank registered (etcd holds no stale ranks)
        lines = [f"etcd {st['address']}: lease TTL {st['lease_s']:g}s, {auth}"]
    else:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st["started_at"]))
        lines = [f"bootstrap {addr}: started {started}, lease {st['lease_s']:g}s, {auth}"]
    head = ("ENGINE", "ROLE", "TP", "RANK", "EPOCH", "ENDPOINT", "BACKEND", "AGE", "STATE")
    body = [(r["engine_id"], r["role"], str(r["tp_size"]), str(r["tp_rank"]), str(r["epoch"]),
             r["ctrl_endpoint"], r["backend"], f"{r['age_s']:.1f}s",
             "stale" if r["stale"] else "live") for r in rows]
    if not body:
        return "\n".join(lines + ["(no ranks registered)"])
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    for row in (head, *body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def status(argv: list[str]) -> int:
    args = _status_parser().parse_args(argv)
    try:
        token = load_token(token_file=args.token_file)
        client = open_rendezvous(args.addr, token=token, request_timeout_s=args.timeout)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        st = client.status()
    except BootstrapAuthError as exc:
        print(f"error: refused: {exc}", file=sys.stderr)
        return EXIT_AUTH
    except BootstrapTimeout as exc:
        print(f"error: {args.addr} unreachable (no answer within {args.timeout:g}s): {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BootstrapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        client.close()
    print(json.dumps(st, indent=2) if args.json else _table(st, args.addr))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "status":
        return status(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
