"""Overlapped communication beside its waited-at-once twin: ZeRO-1/2's weight all-gather after the step (waited
per buffer in the next forward, or all at once after the step) and HSDP's replicate all-reduce (in flight until
the backward's reductions are all issued, or waited right after each shard's reduce-scatter).

Each pair trains the same model on the same per-rank batches on gloo ranks this script starts, the systems
taking turns of a few consecutive steps (an overlapped gather overlaps the next step's forward), each turn timed
between barriers up to its last gathers' end, the median turn counting, so load from other processes hits all
alike. Per system: the median time per step, and the seconds per step each rank spent blocked in the
collective the pair is about (meshlm.parallel.timers: comm/all_gather, comm/all_reduce; busiest rank).
ZeRO pairs run at world 2 (one shard group), HSDP pairs at world 4 (two shard groups of 2, replicated).

    .venv/bin/python benchmarks/overlap.py   # small preset: 11 CPU-minutes (16 min wall at load average 100 on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from meshlm.config import TrainSection
from meshlm.model import Transformer, preset
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.timers import TIMERS
from meshlm.testing import run_distributed
from meshlm.train.optim import build_optimizer

# name -> (parallel options, DataParallel attribute set off for the twin, or None, the collective it is about)
ZERO_SYSTEMS = {
    "zero1, gather waited after the step": ({"zero": 1}, "overlap_gather", "all_gather"),
    "zero1, gather waited in the forward": ({"zero": 1}, None, "all_gather"),
    "zero2, gather waited after the step": ({"zero": 2}, "overlap_gather", "all_gather"),
    "zero2, gather waited in the forward": ({"zero": 2}, None, "all_gather"),
}
HYBRID1, HYBRID2 = {"zero": 1, "zero_shard_size": 2}, {"zero": 2, "zero_shard_size": 2}
HSDP_SYSTEMS = {
    "hybrid zero1, replicate all-reduce waited at once": (HYBRID1, "overlap_replicate", "all_reduce"),
    "hybrid zero1, replicate all-reduce in flight": (HYBRID1, None, "all_reduce"),
    "hybrid zero2, replicate all-reduce waited at once": (HYBRID2, "overlap_replicate", "all_reduce"),
    "hybrid zero2, replicate all-reduce in flight": (HYBRID2, None, "all_reduce"),
}


def bench(systems: dict, preset_name: str, batch: int, seq: int, rounds: int, turn: int, warmup: int) -> dict:
    """Build every system, then run `warmup + rounds` rounds in which each system takes a turn of `turn`
    consecutive steps (an overlapped gather needs the next step's forward); time the last `rounds` turns."""
    world, rank = dist.get_world_size(), dist.get_rank()
    train = TrainSection(steps=(warmup + rounds) * turn, global_batch=batch * world, lr=1e-3, warmup_steps=0)
    models = {}
    for name, (options, off, _) in systems.items():
        torch.manual_seed(0)
        pm = parallelize(Transformer(preset(preset_name)), build_mesh(parse_layout("", world), "cpu"), options)
        if off is not None:
            setattr(pm.dp, off, False)
        models[name] = pm, build_optimizer(pm, train)
    vocab = preset(preset_name).vocab_size
    tokens = torch.randint(0, vocab, (8, batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    wall: dict[str, list[float]] = {s: [] for s in systems}
    blocked: dict[str, list[float]] = {s: [] for s in systems}
    losses: dict[str, list[float]] = {s: [] for s in systems}
    TIMERS.enable()
    for i in range(warmup + rounds):
        for name, (pm, opt) in models.items():
            dist.barrier()
            TIMERS.take()
            start = time.perf_counter()
            for j in range(turn):
                x = tokens[(i * turn + j) % len(tokens)]
                loss = pm.forward_backward(x[:, :-1], x[:, 1:])
                pm.clip_grad_norm_(1.0)
                opt.step()
                pm.after_optimizer_step()
                pm.zero_grad()
                losses[name].append(float(loss))
            pm.dp.settle_gathers()  # the turn's last gathers count in it, not in the next system's turn
            seconds = (time.perf_counter() - start) / turn
            dist.barrier()
            if i >= warmup:
                wall[name].append(seconds)
                blocked[name].append(TIMERS.take().get(f"comm/{systems[name][2]}", 0.0) / turn)
    TIMERS.disable()
    return {
        s: {"step_s": statistics.median(wall[s]), "blocked_s": statistics.median(blocked[s]), "losses": losses[s]}
        for s in systems
    }


def table(systems: dict, ranks: list[dict]) -> None:
    names = list(systems)
    print("| system | s/step (median turn) | blocked in its collective s/step (max rank) |")
    print("|---|---:|---:|")
    for name in names:
        step = ranks[0][name]["step_s"]
        print(f"| {name} | {step:.4f} | {max(r[name]['blocked_s'] for r in ranks):.4f} |")
    for waited, overlapped in zip(names[::2], names[1::2], strict=True):
        speed = ranks[0][waited]["step_s"] / ranks[0][overlapped]["step_s"]
        same = all(r[waited]["losses"] == r[overlapped]["losses"] for r in ranks)
        print(f"\n{overlapped} / {waited}: step-time speed-up {speed:.3f}×, losses bit-identical: {same}", end="")
    print("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="timed turns per system")
    parser.add_argument("--turn", type=int, default=4, help="consecutive steps per turn")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    shape = (args.preset, args.batch, args.seq, args.rounds, args.turn, args.warmup)
    print(f"preset {args.preset}, {args.batch}×{args.seq} tokens per rank per step, gloo on CPU\n")
    for world, systems in ((2, ZERO_SYSTEMS), (4, HSDP_SYSTEMS)):
        print(f"world {world}:\n")
        table(systems, run_distributed(bench, world, systems, *shape, timeout=1800))


if __name__ == "__main__":
    main()
