"""On one CUDA GPU: llama3-1b-shaped training with NCCL and bf16 autocast at world 1, meshlm beside FSDP2.

One prepared run (about 2 minutes on an H100/H200; it stops timing early to stay within --budget-s): each
system builds the same model (same init seed), trains `--warmup` untimed steps, then `--steps` timed ones on
the same batches. Rows:
  meshlm, read every k   meshlm's hot path without host syncs (`train.sync_every = k`): `device_train_step`,
                         loss and norm stacked on the device and read once per k steps;
  meshlm, read each step `train.sync_every = 1`: `train_step`, loss and norm read before every update;
  FSDP2                  per-block `fully_shard` (world 1), the same autocast, AdamW and clipping, loss read
                         once per k steps like the first row.
Systems run one after another (each frees its memory first), so peak memory is each system's own. Tokens/s
is over the whole timed window (one device sync at each end); MFU is model FLOPs (meshlm.model.flops) over
the GPU's datasheet bf16 peak (meshlm.observe.peak). Prints a markdown table and meshlm / FSDP2 ratios.
Without a CUDA device it prints "no CUDA device" and exits 0.

    python benchmarks/gpu/run.py
    python benchmarks/gpu/run.py --batch 2 --seq-len 4096 --steps 10
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshlm.config import ParallelSection, TrainSection
from meshlm.model import Transformer, cross_entropy_loss, flops_per_token, preset
from meshlm.observe.peak import mfu_basis, peak_flops
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train.optim import build_optimizer, device_train_step, train_step

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float]


def meshlm_system(cfg, train: TrainSection, deferred: bool) -> Step:
    mesh = build_mesh(parse_layout("", 1), "cuda")
    with torch.device("meta"):  # materialised on the GPU by ParallelModel, as the trainer builds it
        model = Transformer(cfg, init_seed=0)
    pm = ParallelModel(model, mesh, ParallelSection(), n_micro=1, autocast_dtype=torch.bfloat16)
    opt = build_optimizer(pm, train)
    if deferred:
        return lambda x, y: device_train_step(pm, opt, x, y, train.lr, train.grad_clip)[0]
    return lambda x, y: train_step(pm, opt, x, y, train.lr, train.grad_clip)[0]


def fsdp2_system(cfg, train: TrainSection) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("cuda"):
        model = Transformer(cfg, init_seed=0)
    mesh = init_device_mesh("cuda", (1,))
    for block in model.model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(name: str, build: Callable[[], Step], batches: list[torch.Tensor], args, deadline: float) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = build()
    pending: list = []
    losses: list[float] = []

    def read() -> None:  # one device sync for the losses of the steps since the last read
        losses.extend(torch.stack(pending).tolist() if torch.is_tensor(pending[0]) else pending)
        pending.clear()

    def run(tokens: torch.Tensor) -> None:
        pending.append(step(tokens[:, :-1], tokens[:, 1:]))
        if len(pending) == args.every:
            read()

    for tokens in batches[: args.warmup]:
        run(tokens)
    torch.cuda.synchronize()
    start, timed = time.perf_counter(), 0
    for tokens in batches[args.warmup :]:
        run(tokens)
        timed += 1
        if time.perf_counter() > deadline:
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if pending:
        read()
    return {
        "name": name,
        "steps": timed,
        "tokens_per_s": timed * args.batch * args.seq_len / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": losses[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="read losses every N steps (deferred rows)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop timing once the run is this old")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu/run.py measures GPU training; nothing to run here")
        return 0
    began = time.perf_counter()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cfg = preset(args.model)
    train = TrainSection(steps=args.warmup + args.steps, global_batch=args.batch, warmup_steps=0)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g).cuda()
        for _ in range(args.warmup + args.steps)
    ]
    systems = [
        (f"meshlm, read every {args.every}", lambda: meshlm_system(cfg, train, deferred=True)),
        ("meshlm, read each step", lambda: meshlm_system(cfg, train, deferred=False)),
        ("FSDP2 fully_shard", lambda: fsdp2_system(cfg, train)),
    ]
    rows = []
    for i, (name, build) in enumerate(systems):
        share = (args.budget_s - (time.perf_counter() - began)) / (len(systems) - i)
        rows.append(measure(name, build, batches, args, time.perf_counter() + share))
    device = torch.device("cuda", 0)
    peak = peak_flops(device)
    flops_tok = flops_per_token(cfg, args.seq_len)
    gpu = torch.cuda.get_device_name(device)
    basis = mfu_basis("cuda", gpu)
    print(f"{gpu}, torch {torch.__version__}, {args.model}, batch {args.batch}×{args.seq_len}, bf16 autocast\n")
    print(f"| system | timed steps | tokens/s | MFU (of {basis}) | peak memory GiB | final loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mfu = r["tokens_per_s"] * flops_tok / peak
        print(
            f"| {r['name']} | {r['steps']} | {r['tokens_per_s']:.0f} | {mfu:.1%} | {r['peak_gib']:.1f} "
            f"| {r['final_loss']:.4f} |"
        )
    fsdp = rows[-1]
    for r in rows[:-1]:
        print(f"\n{r['name']} / FSDP2: tokens/s {r['tokens_per_s'] / fsdp['tokens_per_s']:.3f}, "
              f"peak memory {r['peak_gib'] / fsdp['peak_gib']:.3f}")  # fmt: skip
    print(f"total {time.perf_counter() - began:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
