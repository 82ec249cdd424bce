"""meshlm tensor (+ sequence) parallelism side by side with PyTorch's `parallelize_module` (DTensor).

Both systems shard the same plain model (same seed, same batches) over the tp ranks of a gloo group:
meshlm through `ParallelModel` (its real training path: vocab-parallel loss, clipping, AdamW); torch with
a Colwise/Rowwise plan (vocab-parallel embedding, column-parallel lm_head + `loss_parallel`) and, for SP,
the torchtitan-style plan (SequenceParallel norms, PrepareModuleInput, reduce-scatter outputs), with the
same clipping and AdamW on its DTensors.

Memory: each system in a freshly spawned group of its own (so peak RSS is its own), two steps, then the
bytes of params / grads / optimizer state and of the activations saved by one forward, per rank.
Speed: all systems in one group with their steps interleaved, so that load from elsewhere on a shared
machine hits them alike; tokens/s from the median wall time of a step, and the median CPU seconds per step
of the busiest rank. Prints a markdown table and the meshlm / torch ratios.

    .venv/bin/python benchmarks/tensor_parallel.py          # tiny preset, tp=2, ~2-3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.config import TrainSection
from meshlm.model import Transformer, preset
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.testing import run_distributed
from meshlm.train.optim import build_optimizer, train_step

SYSTEMS = ["meshlm tp", "torch tp", "meshlm tp+sp", "torch tp+sp"]


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's data: a DTensor's local shard, an AsyncCollectiveTensor's
    result (what DTensor's to_local() returns after a collective), or the tensor itself."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the unique storages behind `tensors` (DTensors counted by their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def saved_activation_bytes(
    forward: Callable[[], torch.Tensor], exclude: list[torch.Tensor]
) -> tuple[int, torch.Tensor]:
    """Unique storages autograd saves during one forward + loss (parameters and buffers excluded)."""
    skip = {local(t).untyped_storage().data_ptr() for t in exclude}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if local(t).untyped_storage().data_ptr() not in skip:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return storage_bytes(saved), loss


def torch_plan(model: Transformer, sp: bool) -> dict:
    """torchtitan's Llama plan, adapted to meshlm's HF module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # Under SP the residual stream stays a DTensor (global shape, so Transformer.forward sees the whole
    # sequence length), sharded along the sequence; without SP it is a plain replicated tensor.
    residual = Shard(1) if sp else Replicate()
    plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp
        ),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    for i in model.model.layers:
        block = f"model.layers.{i}"
        plan |= {
            f"{block}.self_attn.q_proj": ColwiseParallel(),
            f"{block}.self_attn.k_proj": ColwiseParallel(),
            f"{block}.self_attn.v_proj": ColwiseParallel(),
            f"{block}.self_attn.o_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
            f"{block}.mlp.gate_proj": ColwiseParallel(),
            f"{block}.mlp.up_proj": ColwiseParallel(),
            f"{block}.mlp.down_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        }
        if sp:
            plan |= {
                f"{block}.input_layernorm": SequenceParallel(),
                f"{block}.post_attention_layernorm": SequenceParallel(),
                f"{block}.self_attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                f"{block}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
    return plan


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> None:
    """torch's clip_grad_norm_ refuses a mix of DTensor and plain gradients (the plain tp plan leaves the
    norms replicated as plain tensors): take the two norms apart and combine them."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = get_total_norm(sharded, foreach=True).full_tensor() ** 2 if sharded else 0.0
    sq = sq + (get_total_norm(plain, foreach=True) ** 2 if plain else 0.0)
    coef = min(1.0, max_norm / (float(sq) ** 0.5 + 1e-6))
    for g in grads:
        g.mul_(coef)


def torch_trainer(model: Transformer, train: TrainSection, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, torch_plan(model, sp))
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)
    vocab = model.cfg.vocab_size

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            return F.cross_entropy(model(x).float().reshape(-1, vocab), y.reshape(-1))

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = forward(x, y)
        with loss_parallel():
            loss.backward()
        clip_grad_norm_(params, train.grad_clip)
        opt.step()
        opt.zero_grad()
        return local(loss).item()

    def memory() -> dict[str, int]:
        states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        return {"params": storage_bytes(params), "optimizer": storage_bytes(states)}

    def activations(x: torch.Tensor, y: torch.Tensor) -> int:
        saved, loss = saved_activation_bytes(lambda: forward(x, y), [*params, *model.buffers()])
        with loss_parallel():
            loss.backward()
        return saved

    return step, memory, activations, lambda: storage_bytes([p.grad for p in params if p.grad is not None])


def meshlm_trainer(model: Transformer, train: TrainSection, sp: bool):
    mesh = build_mesh(parse_layout(f"tp={dist.get_world_size()}", dist.get_world_size()), "cpu")
    pm = parallelize(model, mesh, {"sequence_parallel": sp})
    opt = build_optimizer(pm, train)
    params = [p for _, p in pm.named_parameters()]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return train_step(pm, opt, x, y, train.lr, train.grad_clip)[0]

    def memory() -> dict[str, int]:
        states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        return {"params": storage_bytes(params), "optimizer": storage_bytes(states)}

    def activations(x: torch.Tensor, y: torch.Tensor) -> int:
        saved, loss = saved_activation_bytes(lambda: pm.loss_fn(model(x), y), [*params, *model.buffers()])
        loss.backward()
        return saved

    return step, memory, activations, lambda: storage_bytes([p.grad for p in params if p.grad is not None])


def build(system: str, preset_name: str, batch: int):
    torch.manual_seed(0)
    model = Transformer(preset(preset_name))
    train = TrainSection(global_batch=batch, lr=1e-3, warmup_steps=0)
    make = meshlm_trainer if system.startswith("meshlm") else torch_trainer
    return make(model, train, sp=system.endswith("+sp"))


def batches(n: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """The same token stream for every system and every tp rank."""
    return torch.randint(0, vocab, (n, batch, seq + 1), generator=torch.Generator().manual_seed(0))


def memory_run(system: str, preset_name: str, batch: int, seq: int) -> dict:
    """In a fresh group of its own: two steps, then held bytes, saved activations and peak RSS."""
    step, memory, activations, grad_bytes = build(system, preset_name, batch)
    tokens = batches(2, batch, seq, preset(preset_name).vocab_size)
    first_loss = step(tokens[0, :, :-1], tokens[0, :, 1:])
    step(tokens[1, :, :-1], tokens[1, :, 1:])
    act = activations(tokens[0, :, :-1], tokens[0, :, 1:])
    return {
        "first_loss": first_loss,
        "memory": memory() | {"grads": grad_bytes(), "activations": act},
        "rss": peak_rss_bytes(),
    }


def timing_run(systems: list[str], preset_name: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """All systems in one group, their steps interleaved (rotating order), so that load from elsewhere on
    a shared machine hits them alike. Returns each system's median wall and CPU seconds per step (CPU:
    all threads of this rank, compute plus gloo's copies; steadier than wall time on a shared machine)."""
    steppers = {s: build(s, preset_name, batch)[0] for s in systems}
    tokens = batches(warmup + steps, batch, seq, preset(preset_name).vocab_size)
    wall: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    for i in range(warmup + steps):
        for j in range(len(systems)):
            system = systems[(i + j) % len(systems)]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            steppers[system](tokens[i, :, :-1], tokens[i, :, 1:])
            end_cpu = time.process_time()
            dist.barrier()
            if i >= warmup:
                wall[system].append(time.perf_counter() - start)
                cpu[system].append(end_cpu - start_cpu)
    return {s: (statistics.median(wall[s]), statistics.median(cpu[s])) for s in systems}


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (the same on every tp rank)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    shape = (args.preset, args.batch, args.seq)
    results = {s: run_distributed(memory_run, args.tp, s, *shape, timeout=900) for s in SYSTEMS}
    timing = run_distributed(timing_run, args.tp, SYSTEMS, *shape, args.steps, args.warmup, timeout=900)
    speed = {s: args.batch * args.seq / wall for s, (wall, _) in timing[0].items()}
    cpu_s = {s: max(rank[s][1] for rank in timing) for s in SYSTEMS}

    print(f"preset {args.preset}, tp={args.tp}, {args.batch}×{args.seq} tokens per step, gloo on CPU\n")
    print(
        "| system | tokens/s | CPU s/step (max rank) | step-0 loss | params MiB | grads MiB | optimizer MiB "
        "| saved activations MiB | peak RSS MiB (max rank) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for system, ranks in results.items():
        m, rss = ranks[0]["memory"], max(r["rss"] for r in ranks)
        print(
            f"| {system} | {speed[system]:.0f} | {cpu_s[system]:.3f} | {ranks[0]['first_loss']:.6f} | "
            f"{mib(m['params'])} | {mib(m['grads'])} | {mib(m['optimizer'])} | {mib(m['activations'])} | {mib(rss)} |"
        )
    print()
    for sp in ("", "+sp"):
        mine, theirs = f"meshlm tp{sp}", f"torch tp{sp}"
        print(
            f"{mine} / {theirs}: tokens/s {speed[mine] / speed[theirs]:.2f}, "
            f"CPU s/step {cpu_s[mine] / cpu_s[theirs]:.2f}"
        )


if __name__ == "__main__":
    main()
