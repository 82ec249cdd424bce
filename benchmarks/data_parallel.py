"""meshlm data parallelism and ZeRO side by side with PyTorch's DistributedDataParallel and fully_shard (FSDP2).

All systems train the same model on the same per-rank batches, built side by side in one gloo group, and take
turns step by step: each step is timed between barriers and the median counts, so load from other processes
on a shared machine hits every system alike. Prints a markdown table: tokens/s (from the median step), CPU
seconds per step (all threads of the busiest rank: compute plus gloo's copying, insensitive to time slicing),
bytes held per rank in params / grads / optimizer state right after the optimizer step (meshlm:
DataParallel.memory_report; torch: the same count over its tensors, DTensor shards included), each process's
peak RSS, the meshlm/torch throughput ratios and the DP efficiency (world-N tokens/s over N × world 1).

    .venv/bin/python benchmarks/data_parallel.py            # tiny preset, world 2: about 1.5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import TrainSection
from meshlm.model import Transformer, cross_entropy_loss, preset
from meshlm.parallel.dp.gradients import unique_storage_bytes
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.testing import run_distributed
from meshlm.train.optim import build_optimizer

SYSTEMS = ["meshlm zero0", "torch DDP", "meshlm zero1", "meshlm zero2", "meshlm zero3", "torch FSDP2"]
Step = Callable[[torch.Tensor, torch.Tensor], None]


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    states = [local(v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
        "params": unique_storage_bytes([local(p) for p in params]),
        "grads": unique_storage_bytes([local(p.grad) for p in params if p.grad is not None]),
        "optimizer": unique_storage_bytes(states),
    }


def torch_trainer(system: str, model: Transformer, train: TrainSection) -> tuple[Step, dict[str, int]]:
    """DDP or per-block fully_shard around the plain model, with meshlm's optimizer groups and clipping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if system == "torch DDP":
        net = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.model.layers.values():
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)

    memory: dict[str, int] = {}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        cross_entropy_loss(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        opt.step()
        memory.update(held_bytes(params, opt))
        opt.zero_grad()

    return step, memory


def meshlm_trainer(system: str, model: Transformer, train: TrainSection) -> tuple[Step, dict[str, int]]:
    """meshlm's train_step, spelled out to take the memory report between the optimizer step and zero_grad."""
    mesh = build_mesh(parse_layout("", dist.get_world_size()), "cpu")
    pm = parallelize(model, mesh, {"zero": int(system[-1])})
    opt = build_optimizer(pm, train)
    memory: dict[str, int] = {}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pm.forward_backward(x, y)
        pm.clip_grad_norm_(train.grad_clip)
        opt.step()
        pm.after_optimizer_step()
        if pm.dp is not None:
            memory.update(pm.dp.memory_report(opt))
        else:
            memory.update(held_bytes([p for _, p in pm.named_parameters()], opt))
        pm.zero_grad()

    return step, memory


def bench(systems: list[str], preset_name: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """Build every system, then run `warmup + steps` rounds of one step each; time the last `steps` rounds."""
    world, rank = dist.get_world_size(), dist.get_rank()
    train = TrainSection(steps=warmup + steps, global_batch=batch * world, lr=1e-3, warmup_steps=0)
    trainers = {}
    for system in systems:
        torch.manual_seed(0)
        make = meshlm_trainer if system.startswith("meshlm") else torch_trainer
        trainers[system] = make(system, Transformer(preset(preset_name)), train)
    vocab = preset(preset_name).vocab_size
    tokens = torch.randint(0, vocab, (warmup + steps, batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    wall: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    for i in range(warmup + steps):
        for system, (step, _) in trainers.items():
            dist.barrier()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            step(tokens[i, :, :-1], tokens[i, :, 1:])
            dist.barrier()
            if i >= warmup:
                wall[system].append(time.perf_counter() - wall0)
                cpu[system].append(time.process_time() - cpu0)
    return {
        "results": {
            s: {
                "tokens_per_s": world * batch * seq / statistics.median(wall[s]),
                "cpu_s": statistics.median(cpu[s]),
                "memory": trainers[s][1],
            }
            for s in systems
        },
        "rss": peak_rss_bytes(),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    shape = (args.preset, args.batch, args.seq, args.steps, args.warmup)

    single = run_distributed(bench, 1, ["meshlm zero0"], *shape, timeout=1800)[0]
    ranks = run_distributed(bench, args.world, SYSTEMS, *shape, timeout=1800)
    base = single["results"]["meshlm zero0"]

    print(f"preset {args.preset}, world {args.world}, {args.batch}×{args.seq} tokens per rank per step, gloo on CPU\n")
    print("| system | tokens/s | CPU s/step (max rank) | params MiB | grads MiB | optimizer MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("meshlm, world 1", [base])] + [(s, [r["results"][s] for r in ranks]) for s in SYSTEMS]
    for system, per_rank in rows:
        memory = per_rank[0]["memory"]
        print(
            f"| {system} | {per_rank[0]['tokens_per_s']:.0f} | {max(r['cpu_s'] for r in per_rank):.3f} | "
            f"{mib(memory['params'])} | {mib(memory['grads'])} | {mib(memory['optimizer'])} |"
        )
    speed = {s: ranks[0]["results"][s]["tokens_per_s"] for s in SYSTEMS}
    print()
    print(
        f"peak RSS per rank: world 1 {mib(single['rss'])} MiB; world {args.world}, all systems alive at once: "
        + ", ".join(f"{mib(r['rss'])} MiB" for r in ranks)
    )
    print(f"meshlm zero0 / torch DDP tokens/s: {speed['meshlm zero0'] / speed['torch DDP']:.2f}")
    print(f"meshlm zero3 / torch FSDP2 tokens/s: {speed['meshlm zero3'] / speed['torch FSDP2']:.2f}")
    for system in ("meshlm zero0", "torch DDP"):
        efficiency = speed[system] / (args.world * base["tokens_per_s"])
        cpu = base["cpu_s"] / max(r["results"][system]["cpu_s"] for r in ranks)
        print(
            f"DP efficiency, {system}: {efficiency:.2f} (world {args.world} tokens/s over {args.world} × world 1); "
            f"by CPU time {cpu:.2f} (world 1 CPU s/step over world {args.world})"
        )


if __name__ == "__main__":
    main()
