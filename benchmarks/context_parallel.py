"""Context parallel on CPU, two tables.

--table activations (the default before #51): activation memory per rank against sequence length (cp = 1, 2,
4; ring and Ulysses), measured beside the planner's prediction. Measured: the peak bytes autograd holds saved
for backward during one forward of a batch of one sequence (meshlm.observe.ActivationMeter; parameters
excluded), max over the cp ranks. Predicted: meshlm.plan.memory's per-layer formula (layer_activation_bytes,
with cp) × layers, plus the loss buffers (logits_bytes), fp32. Each cp > 1 row also prints its ratio to cp = 1
at the same length (the planner says exactly 1/cp).

--table torch: one causal attention forward + backward at the same global sequence, side by side in one run
of spawned gloo ranks, rounds alternating the order: meshlm's ring (meshlm.parallel.cp.attention), torch's
own context-parallel ring and no cp (F.scaled_dot_product_attention on the whole sequence in one rank, with
the cores the cp ranks share). torch's public `context_parallel` cannot run on CPU: its dispatcher handles
only the CUDA SDPA ops, and DTensor has no sharding rule for the CPU flash op (NotImplementedError), so
torch's ring is driven here as its dispatcher drives it on CUDA — its `_templated_ring_attention` (+
`_backward`) with the CPU flash op and its backward, its load balancing on (the same chunk layout as
meshlm's), with each of its two K/V rotations (all-gather, its default; all-to-all). Time: median over the
rounds of the slowest rank's seconds, and the median of each round's ratio to meshlm's ring. Peak memory:
the profiler's peak of torch's CPU allocator above the start of one forward + backward (profile_memory),
max over ranks. Every path's output is checked against one process.

    .venv/bin/python benchmarks/context_parallel.py [--table activations] [--seq-lens 256,512,1024] [--cp 1,2,4]
    .venv/bin/python benchmarks/context_parallel.py --table torch [--seq 2048] [--cp 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.profiler import ProfilerActivity, profile

from meshlm.model import Transformer, preset
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel.cp.attention import chunk_positions, ring_attention
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.plan.memory import Candidate, Workload, layer_activation_bytes, logits_bytes
from meshlm.testing import global_batch, run_distributed

MODEL = preset("test").replace(max_seq_len=1024, n_kv_heads=4)  # 4 KV heads: Ulysses runs at cp = 4 too
MiB = 2**20


def measure(seq_len: int, attention: str) -> int:
    """This rank's peak saved-activation bytes in one forward of one sequence (a cp rank: its chunks)."""
    cp = dist.get_world_size()
    layout = f"cp={cp}" if cp > 1 else ""
    mesh = build_mesh(parse_layout(layout, cp), "cpu")
    torch.manual_seed(0)
    model = parallelize(Transformer(MODEL), mesh, {"cp_attention": attention})
    x, y = global_batch(0, 1, seq_len, MODEL.vocab_size)
    with ActivationMeter(model) as meter:
        loss = model.loss_fn(model(model.seq_shard(x)), model.seq_shard(y))
    loss.backward()
    return meter.peak


def predicted(seq_len: int, cp: int) -> float:
    """The planner's activations + loss buffers per rank for the same run."""
    w = Workload(MODEL, seq_len, 1, 1.0, precision="fp32")
    s = Candidate(parse_layout(f"cp={cp}", cp), micro_batch=1)
    layer = layer_activation_bytes(MODEL, seq_len, 1, 1, False, "none", "fp32", True, "meshlm", cp)
    return MODEL.n_layers * layer + logits_bytes(w, s)


def activations_table(seq_lens: list[int], cps: list[int]) -> None:
    print("| seq_len | cp | attention | measured MiB / rank | predicted MiB / rank | meas / pred | meas vs cp=1 |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        base = None
        for cp in cps:
            for attention in ("ring", "ulysses") if cp > 1 else ("ring",):
                got = max(run_distributed(measure, cp, seq_len, attention, timeout=600))
                want = predicted(seq_len, cp)
                base = got if cp == 1 else base
                vs = f"{got / base:.3f} (1/cp = {1 / cp:.3f})" if base else "-"
                name = attention if cp > 1 else "-"
                print(f"| {seq_len} | {cp} | {name} | {got / MiB:.2f} | {want / MiB:.2f} | {got / want:.3f} | {vs} |")


# ---- meshlm's ring against torch's ring and no cp -------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # grouped-query attention, as Llama's


class TorchRing(torch.autograd.Function):
    """torch's context-parallel ring (the functions its DTensor dispatcher calls per SDPA op) on the CPU
    flash op: forward merges the blocks by log-sum-exp, backward passes K/V and their gradients around."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = torch_cp._templated_ring_attention(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True
        )[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grads = torch_cp._templated_ring_attention_backward(
            ctx.group, 2, op, grad_out, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0
        )
        return grads[0], grads[1], grads[2], None


def _inputs(seq: int, rank: int, cp: int) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v, output gradient (same on every rank) and this rank's chunks of them."""
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, h, seq, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    pos = chunk_positions(seq, cp, rank)
    return (*whole, *(t[:, :, pos].contiguous() for t in whole))


def _attend(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if path == "no cp":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if path == "meshlm ring":
        return ring_attention(q, k, v, dist.group.WORLD)
    torch_cp._cp_options.rotate_method = torch_cp._RotateMethod[path.split()[-1].upper().replace("-", "_")]
    return TorchRing.apply(q, k, v, dist.group.WORLD)


def _step(path: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    q, k, v, grad = (t.detach().requires_grad_(i < 3) for i, t in enumerate(tensors))
    out = _attend(path, q, k, v)
    out.backward(grad)
    return out.detach()


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of torch's CPU allocator above its level at the start, while `fn` runs (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return max([0] + [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"])


PATHS = ("meshlm ring", "torch ring all-gather", "torch ring all-to-all", "no cp")


def compare(seq: int, rounds: int) -> dict[str, dict[str, float]]:
    """On each rank: seconds per round and peak bytes of each path, and its output's max |Δ| against one
    process. No cp runs on rank 0 alone with the cores all ranks share, the others waiting at a barrier."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    cores = os.cpu_count() or 1
    q, k, v, grad, *local = _inputs(seq, rank, cp)
    whole = (q, k, v, grad)
    pos = chunk_positions(seq, cp, rank)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result: dict[str, dict[str, float]] = {p: {"seconds": [], "peak": 0.0, "error": 0.0} for p in PATHS}

    def run(path: str) -> float:
        alone = path == "no cp"
        torch.set_num_threads(cores if alone else max(1, cores // cp))
        dist.barrier()
        start = time.perf_counter()
        if not alone or rank == 0:
            out = _step(path, whole if alone else local)
            got = out[:, :, pos] if alone else out
            result[path]["error"] = max(result[path]["error"], (got - want[:, :, pos]).abs().max().item())
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed

    for path in PATHS:  # warm-up, and each path's peak memory
        run(path)
        if path != "no cp" or rank == 0:
            torch.set_num_threads(cores if path == "no cp" else max(1, cores // cp))
            result[path]["peak"] = _peak_bytes(lambda p=path: _step(p, whole if p == "no cp" else local))
        dist.barrier()
    for r in range(rounds):  # alternating: each round in the reverse order of the previous one
        for path in PATHS if r % 2 == 0 else reversed(PATHS):
            result[path]["seconds"].append(run(path))
    return result


def torch_table(seq: int, cp: int, rounds: int) -> None:
    per_rank = run_distributed(compare, cp, seq, rounds, timeout=3600, pg_timeout=1800)
    rounds_s = {p: [max(r[p]["seconds"][i] for r in per_rank) for i in range(rounds)] for p in PATHS}
    times = {p: statistics.median(rounds_s[p]) for p in PATHS}
    mine = "meshlm ring"
    # each round's ratio pairs runs seconds apart, which a shared machine's drifting load moves less
    ratios = {p: statistics.median(t / m for t, m in zip(rounds_s[p], rounds_s[mine], strict=True)) for p in PATHS}
    peaks = {p: max(r[p]["peak"] for r in per_rank) for p in PATHS}
    errors = {p: max(r[p]["error"] for r in per_rank) for p in PATHS}
    print(f"seq {seq}, cp {cp}, {HEADS} query / {KV_HEADS} key-value heads of {HEAD_DIM}, fp32, {rounds} rounds")
    print(
        "| path | s / fwd+bwd | time vs meshlm (median of rounds) | peak MiB / rank | memory vs meshlm | max abs err |"
    )
    print("|---|---|---|---|---|---|")
    for p in PATHS:
        t, m = times[p], peaks[p]
        print(f"| {p} | {t:.3f} | {ratios[p]:.2f} | {m / MiB:.1f} | {m / peaks[mine]:.2f} | {errors[p]:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("activations", "torch"), default="activations")
    parser.add_argument("--seq-lens", default="256,512,1024")
    parser.add_argument("--cp", default=None, help="activations: 1,2,4; torch: 2")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.table == "torch":
        torch_table(args.seq, int(args.cp or 2), args.rounds)
    else:
        activations_table([int(s) for s in args.seq_lens.split(",")], [int(c) for c in (args.cp or "1,2,4").split(",")])


if __name__ == "__main__":
    main()
