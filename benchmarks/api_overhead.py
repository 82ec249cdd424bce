"""The library API against meshlm's built-in step: same model, same batches, alternating step by step.

"built-in" is the trainer's `train_step` (ParallelModel.forward_backward, clip, optimizer, ZeRO gather);
"API" is the loop a user writes with `meshlm.parallelize` (model(x), loss, backward, clip_grad_norm_, step).
Both start from the same weights and take turns each step (alternating which goes first), so a slower
machine or a noisy neighbour hits both alike; the median step time counts, and the median CPU time per step
(this process's, single-threaded) is insensitive to time slicing on a shared machine. Prints a markdown table and the
API/built-in ratio.

    .venv/bin/python benchmarks/api_overhead.py                    # tiny preset, 40 steps each, ~1 minute
    .venv/bin/python benchmarks/api_overhead.py --zero 1 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import meshlm
from meshlm.config import ParallelSection, TrainSection
from meshlm.model import Transformer, preset
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train.optim import build_optimizer, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = preset(args.model)
    train = TrainSection(steps=args.steps, global_batch=args.batch, warmup_steps=0)
    mesh = build_mesh(parse_layout("", 1), "cpu")

    torch.manual_seed(0)
    builtin = ParallelModel(Transformer(cfg), mesh, ParallelSection(zero=args.zero), n_micro=1)
    builtin_opt = build_optimizer(builtin, train)
    torch.manual_seed(0)
    api = meshlm.parallelize(Transformer(cfg), mesh, zero=args.zero)
    api_opt = build_optimizer(api, train)

    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"built-in": [], "API": []}
    cpu: dict[str, list[float]] = {"built-in": [], "API": []}
    losses: dict[str, list[float]] = {"built-in": [], "API": []}

    def builtin_step(x: torch.Tensor, y: torch.Tensor) -> float:
        return train_step(builtin, builtin_opt, x, y, train.lr, train.grad_clip)[0]

    def api_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = api.loss_fn(api(x), y)
        api.backward(loss)
        api.clip_grad_norm_(train.grad_clip)
        api.step(api_opt)
        return api.replica_mean(loss).item()

    steps = {"built-in": builtin_step, "API": api_step}
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        order = list(steps) if step % 2 == 0 else list(reversed(steps))  # neither always runs first
        for name in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[name].append(steps[name](x, y))
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)

    tokens_per_step = args.batch * args.seq_len
    print(f"model {args.model}, zero {args.zero}, batch {args.batch}×{args.seq_len}, {args.steps} steps each\n")
    print("| path | median step (ms) | median CPU s / step | tokens/s | final loss |")
    print("|---|---|---|---|---|")
    medians, cpus = {}, {}
    for name, ts in times.items():
        medians[name], cpus[name] = statistics.median(ts), statistics.median(cpu[name])
        print(
            f"| {name} | {medians[name] * 1e3:.1f} | {cpus[name]:.3f} | {tokens_per_step / medians[name]:.0f} "
            f"| {losses[name][-1]:.6f} |"
        )
    print(f"\nAPI / built-in step time: {medians['API'] / medians['built-in']:.3f}")
    print(f"API / built-in CPU time per step (insensitive to time slicing): {cpus['API'] / cpus['built-in']:.3f}")
    print(f"identical losses: {losses['API'] == losses['built-in']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
