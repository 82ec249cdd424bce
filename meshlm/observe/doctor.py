"""`meshlm doctor`: measure this cluster before planning on it.

Per mesh dimension of a layout it sweeps message sizes through all-reduce, all-gather and reduce-scatter on
every group of that dimension, and send/recv between ring neighbours one pair at a time (so a slow link shows
as itself); on CPU each timed call follows a short compute burst, as in training. Per rank it measures matmul
throughput (alone and with every rank multiplying at once), memory bandwidth, and the fixed host time of a
layer's forward + backward and of the rest of a micro-batch. Rank 0 prints a table that flags
outliers and writes `--out doctor.json`: the planner's calibration (meshlm.plan.Calibration, docs/planner.md),
with every measurement under its free-form `notes`. Run it with torchrun (or as one process); `doctor()`
itself runs inside an existing process group (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshlm.observe.bandwidth import OPS, GiB, KiB, MiB, busbw, fit_link
from meshlm.observe.calibration import calibration
from meshlm.observe.memory import process_memory
from meshlm.observe.peak import copy_bandwidth, cpu_cores, matmul_flops
from meshlm.parallel.distributed import init_distributed, resolve_device
from meshlm.parallel.mesh import DIMS, build_mesh, parse_layout

_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_sizes(device_type: str, min_bytes: int = 4 * KiB, max_bytes: int | None = None) -> list[int]:
    """Message sizes ×4 apart from `min_bytes` up to 16 MiB on CPU (gloo), 1 GiB on GPU (NCCL), or `max_bytes`."""
    top = max_bytes or (GiB if device_type == "cuda" else 16 * MiB)
    sizes, size = [], min_bytes
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _operation(op: str, nbytes: int, n: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """One call of `op` over a buffer of `nbytes` (the nccl-tests size, see bandwidth.py)."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: _all_gather_into_tensor(full, part, group=group)
    return lambda: _reduce_scatter_tensor(part, full, group=group)


def _send_recv(nbytes: int, peer: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """Send `nbytes` to `peer` and receive as many from it at the same time."""
    out, into = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)

    def run() -> None:
        ops = [dist.P2POp(dist.isend, out, peer, group), dist.P2POp(dist.irecv, into, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return run


def _burst(device: torch.device) -> Callable[[], None] | None:
    """About a millisecond of matmuls (4 of 192×192) to run before each timed call on CPU. In training a
    collective follows compute, and a rank that reached it first has gone to sleep and must be woken; calls
    issued back to back keep every rank awake and never pay that (on this kind of machine: ~0.1 against
    ~0.7 ms per gloo all-reduce). None on GPU, where NCCL calls queue behind the kernels asynchronously."""
    if device.type != "cpu":
        return None
    a = torch.randn(192, 192)

    def run() -> None:
        for _ in range(4):
            torch.mm(a, a)

    return run


def _time(
    fn: Callable[[], None],
    group: dist.ProcessGroup,
    device: torch.device,
    iters: int,
    budget_s: float,
    burst: Callable[[], None] | None = None,
) -> float:
    """Seconds per call on this rank; the group agrees on the iteration count from a timed warm-up call
    (after an untimed first one, which may set up connections or communicators). With a `burst`, each call
    follows one and only the calls are timed (their mean, as a training step pays it)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    warm = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
    count = int(max(2, min(iters, budget_s / max(warm.item(), 1e-6))))
    dist.barrier(group=group)
    if burst is None:
        start = time.perf_counter()
        for _ in range(count):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / count
    total = 0.0
    for _ in range(count):
        burst()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return total / count


def small_all_reduce_seconds(group: dist.ProcessGroup | None = None, budget_s: float = 0.3) -> float:
    """Seconds per 4 KiB all-reduce on CPU, each after a burst of compute as a training step pays it: the
    latency that sets a small model's distributed step (and the test suite's wall time). Call it on every
    rank of `group` (default: the whole world)."""
    group = group or dist.group.WORLD
    cpu = torch.device("cpu")
    call = _operation("all_reduce", 4 * KiB, dist.get_world_size(group), group, cpu)
    return _time(call, group, cpu, 200, budget_s, _burst(cpu))


def _measure_dim(
    dim: str, group: dist.ProcessGroup, sizes: list[int], device: torch.device, iters: int, budget_s: float
) -> list[dict]:
    """This rank's seconds per call: every collective on its group, then each ring pair's exchange."""
    ranks = dist.get_process_group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    burst = _burst(device)
    rows = []
    for op in OPS[:3]:
        seconds = [_time(_operation(op, s, n, group, device), group, device, iters, budget_s, burst) for s in sizes]
        rows.append({"dim": dim, "op": op, "group": ranks, "seconds": seconds})
    for i in range(n if n > 2 else 1):  # one ring pair at a time; the rest of the group idles
        pair = (i, (i + 1) % n)
        seconds = []
        for size in sizes:
            call = _send_recv(size, ranks[sum(pair) - me], group, device) if me in pair else _idle
            seconds.append(_time(call, group, device, iters, budget_s, burst))
        if me in pair:
            rows.append({"dim": dim, "op": "send_recv", "group": [ranks[r] for r in pair], "seconds": seconds})
    return rows


def _idle() -> None:
    pass


def _collate(per_rank: list[list[dict]], sizes: list[int], outlier: float) -> list[dict]:
    """One row per (dim, op, group): the slowest member's time, bandwidths, the α–β fit and an outlier flag."""
    merged: dict[tuple, list[list[float]]] = {}
    for rows in per_rank:
        for row in rows:
            merged.setdefault((row["dim"], row["op"], tuple(row["group"])), []).append(row["seconds"])
    out = []
    for dim, op, group in sorted(merged, key=lambda k: (DIMS.index(k[0]), OPS.index(k[1]), k[2])):
        times = merged[(dim, op, group)]
        n = 2 if op == "send_recv" else len(group)
        seconds = [max(t) for t in zip(*times, strict=True)]
        alpha, beta = fit_link(op, n, sizes, seconds)
        out.append({
            "dim": dim, "op": op, "group": list(group), "sizes": sizes, "seconds": seconds,
            "algbw_Bps": [s / t for s, t in zip(sizes, seconds, strict=True)],
            "busbw_Bps": [busbw(op, n, s, t) for s, t in zip(sizes, seconds, strict=True)],
            "alpha_s": alpha, "beta_Bps": beta, "slow": False,
        })  # fmt: skip
    for dim, op in {(r["dim"], r["op"]) for r in out}:
        peers = [r for r in out if (r["dim"], r["op"]) == (dim, op)]
        median = statistics.median(r["busbw_Bps"][-1] for r in peers)
        for r in peers:
            r["slow"] = len(peers) > 1 and r["busbw_Bps"][-1] < outlier * median
    return out


def doctor(
    layout: str = "",
    device: torch.device | str = "cpu",
    sizes: list[int] | None = None,
    iters: int = 20,
    budget_s: float = 0.5,
    matmul_n: int | None = None,
    matmul_seconds: float = 0.5,
    slow_rank: int | None = None,
    slow_factor: float = 3.0,
    outlier: float = 0.8,
) -> dict:
    """Measure links and matmul throughput inside an initialised process group; every rank gets the report.

    `slow_rank` (default: $MESHLM_SLOW_RANK) makes that rank's matmul `slow_factor` ($MESHLM_SLOW_FACTOR)
    times slower, to check that outliers and stragglers are caught."""
    device = torch.device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    parsed = parse_layout(layout, world)
    sizes = sizes or default_sizes(device.type)
    if slow_rank is None and os.environ.get("MESHLM_SLOW_RANK"):
        slow_rank = int(os.environ["MESHLM_SLOW_RANK"])
        slow_factor = float(os.environ.get("MESHLM_SLOW_FACTOR", slow_factor))

    framework = _framework_bytes(device)
    cuda = device.type == "cuda"
    # device figures first: after the collective sweep gloo keeps the CPU busy for a while
    dist.barrier()  # all ranks measure at once: ranks sharing a CPU each see their share
    bandwidth = copy_bandwidth(GiB if cuda else 64 * MiB, device)
    dtype = torch.bfloat16 if cuda else torch.float32
    rates = _shared_matmul(
        matmul_n or (8192 if cuda else 512), dtype, device, matmul_seconds, slow_factor if rank == slow_rank else 1.0
    )
    layer_s, micro_batch_s = host_overhead(device)
    rows: list[dict] = []
    dims = [d for d in DIMS if getattr(parsed, d) > 1]
    if dims:
        mesh = build_mesh(parsed, device.type)
        for dim in dims:
            rows += _measure_dim(dim, mesh.group(dim), sizes, device, iters, budget_s)

    me = {
        "rank": rank,
        "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        **rates,
        "memory_bw": bandwidth,
        "framework_bytes": framework,
        "cores": cpu_cores(),
        "threads": torch.get_num_threads(),
        "layer_overhead_s": layer_s,
        "micro_batch_overhead_s": micro_batch_s,
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (me, rows))
    ranks = [r for r, _ in gathered]
    median = statistics.median(r["matmul_flops"] for r in ranks)
    for r in ranks:
        r["slow"] = r["matmul_flops"] < outlier * median
    collectives = _collate([rows for _, rows in gathered], sizes, outlier)
    return {
        "version": 1,
        "device": "cuda" if cuda else "cpu",
        "backend": dist.get_backend(),
        "dtype": "bf16" if cuda else "fp32",
        "torch": torch.__version__,
        "world_size": world,
        "layout": str(parsed),
        "outlier_threshold": outlier,
        "ranks": ranks,
        "collectives": collectives,
        "outliers": _outliers(ranks, collectives, median, outlier),
    }


def _shared_matmul(
    n: int, dtype: torch.dtype, device: torch.device, seconds: float, slow_factor: float = 1.0, repeats: int = 5
) -> dict:
    """Matmul rates on this rank. `matmul_alone_flops` (local rank 0 only): one thread multiplying while the
    host's other ranks wait. Then, in each of `repeats` rounds, every rank runs the same number of n×n
    matmuls from a barrier, on CPU with enough threads that the host's ranks keep every core busy:
    `matmul_flops` is this rank's own rate (`slow_factor` slows it, see `matmul_flops`), and
    `matmul_shared_flops` counts until the last rank is done, so ranks that time-share cores each get their
    share even where their runs would not overlap otherwise. The own rate is the median round; the shared
    rate is the best round, as load from elsewhere (or ranks still starting up) only ever lowers it."""
    cpu = device.type == "cpu"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    threads = max(1, -(-cpu_cores() // local_world)) if cpu else torch.get_num_threads()
    alone = None
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        alone = matmul_flops(n, dtype, device, seconds / 2)
        torch.set_num_threads(previous)
    dist.barrier()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    estimate = torch.tensor([matmul_flops(n, dtype, device, seconds / 10)], device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MIN)
    iters = max(4, int(seconds / repeats * estimate.item() / (2 * n**3)))
    a = torch.randn(n, n, dtype=dtype, device=device)
    own, together = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, a)
        _sync(device)
        elapsed = time.perf_counter() - start
        if slow_factor > 1:
            time.sleep(elapsed * (slow_factor - 1))
        own.append(time.perf_counter() - start)
        dist.barrier()
        together.append(time.perf_counter() - start)
    torch.set_num_threads(previous)
    work = 2 * n**3 * iters
    return {
        "matmul_flops": work / statistics.median(own),
        "matmul_shared_flops": work / min(together),
        "matmul_alone_flops": alone,
        "matmul_threads": threads,
    }


def host_overhead(device: torch.device, reps: int = 30) -> tuple[float, float]:
    """(seconds per layer, seconds per micro-batch besides the layers) of host time that does not grow with
    size: forward + loss + backward of meshlm Transformers so small (dim 16, 8 tokens) that their compute is
    nil, with 1 and 3 layers; every rank runs the same steps from a barrier to a barrier, so where ranks share
    cores the time includes waiting for one (calibration() divides that out)."""
    from meshlm.model import ModelConfig, Transformer
    from meshlm.model.llama import cross_entropy_loss

    def step_seconds(layers: int) -> float:
        cfg = ModelConfig(vocab_size=16, dim=16, n_layers=layers, n_heads=2, n_kv_heads=1, intermediate_size=16)
        model = Transformer(cfg).to(device)
        x = torch.randint(0, 16, (1, 8), device=device)

        def step() -> None:
            cross_entropy_loss(model(x), x).backward()

        for _ in range(3):
            step()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        _sync(device)
        dist.barrier()
        return (time.perf_counter() - start) / reps

    one, three = step_seconds(1), step_seconds(3)
    layer = max(0.0, (three - one) / 2)
    return layer, max(0.0, one - layer)


def _framework_bytes(device: torch.device) -> int:
    """Memory a process holds besides tensors: on GPU what the driver reports used beyond the caching
    allocator (CUDA context, NCCL); on CPU the process RSS before any measurement (python + torch)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device)
    return process_memory().get("mem_rss_bytes", 0)


def _outliers(ranks: list[dict], collectives: list[dict], median: float, outlier: float) -> list[str]:
    lines = [
        f"rank {r['rank']} ({r['host']}): matmul {_rate(r['matmul_flops'])} < {outlier}× median {_rate(median)}"
        for r in ranks
        if r["slow"]
    ]
    lines += [
        f"{r['dim']} {r['op']} ranks {r['group']}: bus bandwidth {_gbps(r['busbw_Bps'][-1])} at "
        f"{_size(r['sizes'][-1])} is below {outlier}× the median of its dimension"
        for r in collectives
        if r["slow"]
    ]
    return lines


# ---- the table ----------------------------------------------------------------------------------------------
def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _gbps(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s"


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def print_report(report: dict, console: Console | None = None) -> None:
    """Links, then ranks; outliers in red."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)  # logs: no 80-column wrap
    links = Table(title=f"Links ({report['backend']}, layout {report['layout']})")
    sizes = report["collectives"][0]["sizes"] if report["collectives"] else [0]
    columns = ("dim", "op", "ranks", f"time {_size(sizes[0])}", f"busbw {_size(sizes[-1])}", "α/step", "β busbw")
    for column in columns:
        links.add_column(column, justify="left" if column in ("dim", "op", "ranks") else "right")
    for r in report["collectives"]:
        links.add_row(
            r["dim"],
            r["op"],
            ",".join(map(str, r["group"])),
            f"{r['seconds'][0] * 1e6:.0f} µs",
            _gbps(r["busbw_Bps"][-1]),
            f"{r['alpha_s'] * 1e6:.1f} µs",
            _gbps(r["beta_Bps"]),
            style="bold red" if r["slow"] else None,
        )
    ranks = Table(title="Ranks")
    for column in ("rank", "host", "device", "matmul", "memory copy", ""):
        ranks.add_column(column)
    for r in report["ranks"]:
        cells = (str(r["rank"]), r["host"], r["device_name"], _rate(r["matmul_flops"]), _gbps(r["memory_bw"]))
        ranks.add_row(*cells, "SLOW" if r["slow"] else "", style="bold red" if r["slow"] else None)
    if report["collectives"]:
        console.print(links)
    console.print(ranks)
    for line in report["outliers"]:
        console.print(f"[bold red]outlier:[/] {line}")
    if not report["outliers"]:
        console.print(f"no outliers (threshold {report['outlier_threshold']}× median)")


# ---- command line -------------------------------------------------------------------------------------------
def run_doctor(args: argparse.Namespace) -> int:
    """Join (or create) the process group, measure, and on rank 0 print the table and write the JSON files."""
    device = resolve_device(args.device)
    created = init_distributed(device, args.timeout_s)
    try:
        sizes = default_sizes(device.type, args.min_bytes, args.max_bytes)
        if not sizes:
            print(f"meshlm doctor: no message sizes between {args.min_bytes} and {args.max_bytes}", file=sys.stderr)
            return 2
        report = doctor(
            args.layout, device, sizes, args.iters, args.budget_s, args.matmul_size,
            slow_rank=args.slow_rank, slow_factor=args.slow_factor, outlier=args.outlier,
        )  # fmt: skip
        if dist.get_rank() == 0:
            print_report(report)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(calibration(report), indent=2) + "\n")
            print(f"calibration written to {args.out} (meshlm plan --calibration {args.out})")
        return 0
    finally:
        if created:
            dist.destroy_process_group()
