"""`meshlm lighthouse`: torchft's lighthouse (LighthouseServer), the quorum service of fault-tolerant replica groups
(meshlm.train.replicas), in the foreground until SIGTERM or SIGINT (exit 0).

Its timeouts are the first rungs of the ladder in docs/fault-tolerance.md: a group that stops heartbeating for
`heartbeat_timeout_s` leaves the healthy set (with two groups the survivor needs this: a quorum must hold more
than half the healthy groups); a quorum that has more than half waits at most `join_timeout_s` for a healthy
group that has not asked yet (with three or more groups, a dead one is dropped after min(join, heartbeat)).
"""

from __future__ import annotations

import argparse
import signal
import threading

from meshlm.errors import ConfigError

# imported by meshlm.train.replicas; here so that the CLI's parser (this module) starts without torch
EXTRA_LINE = "fault.replica_groups > 1 needs torchft: pip install 'meshlm[ft]' (torchft-nightly and numpy)"


def add_lighthouse_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("lighthouse", help="run the quorum service of fault-tolerant replica groups (torchft)")
    p.add_argument("--port", type=int, default=29510, help="port to listen on, all interfaces (default 29510)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest groups a quorum may hold (default 1)")
    p.add_argument("--join-timeout-s", type=float, default=3.0, help="longest wait for a healthy group that has "
                   "not asked yet, once a quorum is possible (default 3)")  # fmt: skip
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0, help="a group silent this long is dead "
                   "(default 5)")  # fmt: skip
    return p


def run_lighthouse(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; prints its address once (what groups give as fault.lighthouse)."""
    if args.min_replicas < 1 or not 0 < args.port < 65536:
        raise ConfigError(f"meshlm lighthouse: --min-replicas must be >= 1 and --port 1..65535, got "
                          f"{args.min_replicas} and {args.port}")  # fmt: skip
    if args.join_timeout_s <= 0 or args.heartbeat_timeout_s <= 0:
        raise ConfigError("meshlm lighthouse: --join-timeout-s and --heartbeat-timeout-s must be > 0")
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise ConfigError(EXTRA_LINE) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=round(args.join_timeout_s * 1000),
            heartbeat_timeout_ms=round(args.heartbeat_timeout_s * 1000),
        )
    except Exception as e:
        raise ConfigError(f"meshlm lighthouse: cannot listen on port {args.port}: {e}") from None
    print(f"meshlm lighthouse: listening at {server.address()} (fault.lighthouse = HOST:{args.port})", flush=True)
    stop.wait()
    server.shutdown()
    return 0
