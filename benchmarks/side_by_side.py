"""What the one-process, two-path step benchmarks share: arguments, set-up, taking turns, the table.

Two paths take turns step by step (alternating which goes first), so a slower machine or a noisy neighbour
hits both alike; the median wall time per step counts, and the median CPU time of this process per step is
insensitive to time slicing on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist

from meshlm.config import TrainSection
from meshlm.model import ModelConfig, preset
from meshlm.parallel.mesh import Mesh, build_mesh, parse_layout


def step_arguments(doc: str, steps: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    return parser


def one_process(args: argparse.Namespace) -> tuple[ModelConfig, TrainSection, Mesh]:
    """A world of one on gloo, the model preset, its training settings and the trivial mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train = TrainSection(steps=args.steps, global_batch=args.batch, warmup_steps=0)
    return preset(args.model), train, build_mesh(parse_layout("", 1), "cpu")


def take_turns(steps: dict[str, Callable[[], None]], n: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run each path's step n times, alternating the order; wall and CPU seconds per step per path."""
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(n):
        for name in list(steps) if step % 2 == 0 else list(reversed(steps)):  # neither always runs first
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def print_ratio_table(
    wall: dict[str, list[float]], cpu: dict[str, list[float]], losses: dict[str, list[float]], tokens_per_step: int
) -> None:
    """The markdown table, then the second path over the first, in wall and CPU time."""
    print("| path | median step (ms) | median CPU s / step | tokens/s | final loss |")
    print("|---|---|---|---|---|")
    medians = {name: statistics.median(ts) for name, ts in wall.items()}
    cpus = {name: statistics.median(ts) for name, ts in cpu.items()}
    for name in wall:
        print(
            f"| {name} | {medians[name] * 1e3:.1f} | {cpus[name]:.3f} | {tokens_per_step / medians[name]:.0f} "
            f"| {losses[name][-1]:.6f} |"
        )
    base, other = list(wall)
    print(f"\n{other} / {base} step time: {medians[other] / medians[base]:.3f}")
    print(f"{other} / {base} CPU time per step (insensitive to time slicing): {cpus[other] / cpus[base]:.3f}")
    print(f"identical losses: {losses[other] == losses[base]}")
