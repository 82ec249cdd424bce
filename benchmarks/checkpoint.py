"""Checkpoint save cost per layout: blocking vs async, and bytes written per rank, beside PyTorch's reference
(FSDP2 `fully_shard` state saved with `torch.distributed.checkpoint`, blocking and `async_save`).

Every system holds the same model after one AdamW step, in one gloo group; each save is repeated and the median
counts. "held" is how long training is stopped by the save call (async: staging copies only), "total" is until
the checkpoint is committed on every rank. Bytes per rank are the sizes of the files each rank wrote.

    .venv/bin/python benchmarks/checkpoint.py                  # small preset (25M parameters), world 4
    .venv/bin/python benchmarks/checkpoint.py --preset tiny --world 2 --repeats 2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshlm.checkpoint import CheckpointIO, training_entries
from meshlm.config import TrainSection
from meshlm.model import Transformer, cross_entropy_loss, preset
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.testing import run_distributed
from meshlm.train.optim import build_optimizer

MESHLM = {  # name -> (layout, zero)
    "meshlm dp zero0": ("", 0),
    "meshlm dp zero1": ("", 1),
    "meshlm dp zero3": ("", 3),
    "meshlm tp": ("tp={world}", 0),
    "meshlm pp2 x dp": ("pp=2", 1),
}
REFERENCE = "torch FSDP2 + DCP"


def batch(cfg: object, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def timed(fn: object) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def rank_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"__{dist.get_rank()}_*.distcp"))


def meshlm_case(name: str, model_name: str, root: Path, repeats: int) -> dict:
    world = dist.get_world_size()
    layout_text, zero = MESHLM[name]
    cfg = preset(model_name)
    layout = parse_layout(layout_text.format(world=world), world)
    torch.manual_seed(0)
    pm = parallelize(Transformer(cfg), build_mesh(layout, "cpu"), {"zero": zero, "micro_batches": layout.pp})
    opt = build_optimizer(pm, TrainSection())
    x, y = batch(cfg, 2 * layout.pp, 64)
    pm.forward_backward(x, y)
    opt.step()
    pm.after_optimizer_step()
    out: dict[str, list[float]] = {"blocking": [], "held": [], "total": []}
    for kind in ("blocking", "async"):
        run = root / f"{name}-{kind}".replace(" ", "_")
        ckpt = CheckpointIO(run, keep=1, async_save=kind == "async", timeout_s=600)
        for step in range(1, repeats + 1):
            held: list[float] = []

            def save(ckpt: CheckpointIO = ckpt, step: int = step, held: list = held) -> None:
                held.append(ckpt.save(step, training_entries(pm, opt, writer=True), {"step": step}))
                ckpt.wait()

            out["blocking" if kind == "blocking" else "total"].append(timed(save))
            if kind == "async":
                out["held"].append(held[0])
        written = rank_bytes(run / "checkpoints" / f"step_{repeats:08d}")
        staging = ckpt.staging_bytes
    return {**{k: statistics.median(v) for k, v in out.items()}, "bytes": written, "staging": staging}


def reference_case(model_name: str, root: Path, repeats: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    cfg = preset(model_name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = batch(cfg, 2, 64)
    cross_entropy_loss(model(x), y).backward()
    opt.step()
    group = dist.new_group(backend="gloo")
    out: dict[str, list[float]] = {"blocking": [], "held": [], "total": []}
    for kind in ("blocking", "async"):
        for step in range(1, repeats + 1):
            folder = root / f"torch-{kind}-{step}"
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            if kind == "blocking":
                out["blocking"].append(timed(lambda state=state, f=folder: dcp.save(state, checkpoint_id=f)))
            else:
                held: list[float] = []

                def save(state: dict = state, f: Path = folder, held: list = held) -> None:
                    start = time.perf_counter()
                    future = dcp.async_save(state, checkpoint_id=f, process_group=group)
                    held.append(time.perf_counter() - start)
                    future.result()

                out["total"].append(timed(save))
                out["held"].append(held[0])
        written = rank_bytes(root / f"torch-{kind}-{repeats}")
    return {**{k: statistics.median(v) for k, v in out.items()}, "bytes": written, "staging": 0}


def job(model_name: str, root: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    results = {name: meshlm_case(name, model_name, Path(root), repeats) for name in MESHLM}
    results[REFERENCE] = reference_case(model_name, Path(root), repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshlm-ckpt-bench-"))
    try:
        ranks = run_distributed(job, args.world, args.preset, str(root), args.repeats, timeout=3600, pg_timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = 2**20
    print(f"preset {args.preset}, world {args.world}, median of {args.repeats} saves\n")
    print("| system | blocking save s | async: held s | async: total s | held / blocking | MiB per rank "
          "(min–max) | MiB total | staging MiB per rank (max) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in [*MESHLM, REFERENCE]:
        rows = [r[name] for r in ranks]
        blocking = max(r["blocking"] for r in rows)
        held = max(r["held"] for r in rows)
        total = max(r["total"] for r in rows)
        sizes = [r["bytes"] / mb for r in rows]
        staging = max(r["staging"] for r in rows) / mb
        print(
            f"| {name} | {blocking:.2f} | {held:.3f} | {total:.2f} | {held / blocking:.2f} | "
            f"{min(sizes):.1f}–{max(sizes):.1f} | {sum(sizes):.1f} | {staging:.1f} |"
        )


if __name__ == "__main__":
    main()
