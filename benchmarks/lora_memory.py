"""Model-state memory per rank: a LoRA fine-tune (frozen base) vs a full fine-tune, under ZeRO-3, measured
on CPU gloo ranks and predicted by the planner (meshlm.plan.memory).

Each rank builds meshlm's Llama (the `small` preset by default, fp32 on CPU), for LoRA applies rank-r adapters
to the attention and MLP projections (meshlm.parallel.transforms.lora.apply_lora: the base frozen), wraps it in a
ParallelModel for the layout and takes one AdamW step. It then reports what it holds (`DataParallel.memory_report`: the
distinct storages of its parameters and masters, gradients and AdamW moments; freed ZeRO-3 weights count
nothing). The planner's prediction is `memory(...)`'s params + grads + optimizer for the same workload
(`Workload(..., lora_rank=r)`): activations are not compared (the planner's are GPU kernels' figures).

    .venv/bin/python benchmarks/lora_memory.py                      # small, dp=2 ZeRO-3, rank 16
    .venv/bin/python benchmarks/lora_memory.py --model test --rank 4 --json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import meshlm
from meshlm.model import Transformer, preset
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.transforms.lora import apply_lora
from meshlm.plan.hardware import hardware
from meshlm.plan.memory import Candidate, Workload, memory
from meshlm.testing import global_batch, run_distributed

MIB = 2**20


def measure(model_name: str, layout: str, zero: int, rank: int, seq_len: int) -> dict[str, int]:
    """One rank: build, adapt (rank > 0), parallelize, one AdamW step; the bytes it then holds."""
    import torch.distributed as dist

    cfg = preset(model_name)
    mesh = build_mesh(parse_layout(layout, dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    model = Transformer(cfg)
    if rank:
        apply_lora(model, rank, 2.0 * rank)
    pm = meshlm.parallelize(model, mesh, {"zero": zero})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    dp = mesh.size("dp")
    x, y = global_batch(0, 2 * dp, seq_len, cfg.vocab_size)
    pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
    pm.step(opt)
    return pm.dp.memory_report(opt)


def predict(model_name: str, layout: str, zero: int, rank: int, seq_len: int, world: int) -> dict[str, float]:
    w = Workload(preset(model_name), seq_len, 2 * world, 1.0, "fp32", model_name, rank)
    mem = memory(w, Candidate(mesh=parse_layout(layout, world), options=ParallelOptions(zero=zero)), hardware("cpu"))
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--layout", default="dp=2")
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the LoRA run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    world = math.prod(int(part.split("=")[1]) for part in args.layout.split(","))
    rows = []
    for what, rank in (("full fine-tune", 0), (f"LoRA r={args.rank}", args.rank)):
        measured = run_distributed(measure, world, args.model, args.layout, args.zero, rank, args.seq_len, timeout=900)
        predicted = predict(args.model, args.layout, args.zero, rank, args.seq_len, world)
        worst = max(measured, key=lambda m: sum(m.values()))
        total_m, total_p = sum(worst.values()), sum(predicted.values())
        rows.append(
            {
                "run": what,
                "measured": worst,
                "predicted": predicted,
                "measured_mib": total_m / MIB,
                "predicted_mib": total_p / MIB,
                "error": total_p / total_m - 1,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.model}, {args.layout} ZeRO-{args.zero}, fp32 on CPU: model state per rank (MiB)")
    print(f"{'run':<16} {'part':<10} {'measured':>10} {'planner':>10}")
    for row in rows:
        for part in ("params", "grads", "optimizer"):
            measured, predicted = row["measured"][part] / MIB, row["predicted"][part] / MIB
            print(f"{row['run']:<16} {part:<10} {measured:>10.2f} {predicted:>10.2f}")
        print(f"{row['run']:<16} {'total':<10} {row['measured_mib']:>10.2f} {row['predicted_mib']:>10.2f}  "
              f"({row['error']:+.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
