"""Set-up memory per rank: meta-device construction with shard-only materialisation vs full-then-shard.

Each run spawns `world` gloo ranks on this machine. A rank builds the model — on `meta` (the meta path, what
`meshlm train` does) or whole in fp32 (the full path, what a model built by hand and passed to `parallelize`
costs) — and wraps it in a ParallelModel for the layout. It reports:

  peak_setup_bytes  the peak resident set (VmHWM, reset just before) above the resident set right before
                    the build: everything set-up touched, imports of PyTorch's meta kernels included;
  shard_bytes       what the rank owns once set up: its parameters (ZeRO: fp32 master shards) and the
                    gradient buffers set-up allocates (ZeRO-3: the reduced-gradient shard; ZeRO-1: the full
                    gradient buffer). Adam's moments (8 bytes per owned element) come with the first step.

Goal: peak_setup_bytes ≤ 1.25 × shard_bytes + 64 MiB on every rank. The full path runs its ranks one
data-parallel group at a time (its set-up has no collective outside that group), freeing each group's model
before the next, so that a model several times the per-rank share fits on one machine; the peaks are per
process, so this does not change them. Pipeline layouts untie the embeddings (a tied weight cannot live on
two stages).

    .venv/bin/python benchmarks/init_memory.py --json                     # llama3-1b, meta path, ~2 minutes
    .venv/bin/python benchmarks/init_memory.py --full                     # + the full path (needs ~17 GB)
    .venv/bin/python benchmarks/init_memory.py --model small --runs dp=4@3
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.model import ModelConfig, Transformer, param_counts, preset
from meshlm.observe.memory import tensor_bytes
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import Mesh, build_mesh, parse_layout
from meshlm.testing import run_distributed

MIB = 2**20
GOAL = "peak_setup_bytes <= 1.25 * shard_bytes + 64 MiB"


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def owned_bytes(pm: ParallelModel) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) this rank holds: storages counted once, freed ZeRO-3 weights (views
    of a storage resized to 0) not at all."""
    params = [p for _, p in pm.named_parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    if pm.dp is not None:
        params += [b.master for b in pm.dp.buffers if b.master is not None]
        grads += [t for b in pm.dp.buffers for t in (b.full_grad, b.grad_shard) if t is not None]

    def held(tensors: list[torch.Tensor]) -> int:
        return tensor_bytes(t for t in tensors if t.untyped_storage().nbytes())

    return held(params), held(grads)


def _set_up(cfg: ModelConfig, mesh: Mesh, zero: int, meta: bool) -> dict:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    start = time.perf_counter()
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
    pm = parallelize(model, mesh, {"zero": zero, "micro_batches": mesh.size("pp")})
    del model
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - base
    params, grads = owned_bytes(pm)
    return {
        "rank": dist.get_rank(),
        "peak_setup_bytes": peak,
        "shard_bytes": params + grads,
        "param_bytes": params,
        "grad_bytes": grads,
        "setup_s": round(seconds, 1),
    }


def _rank(cfg: ModelConfig, layout: str, zero: int, meta: bool) -> dict:
    """The meta path on every rank at once; the full path one dp group (same pp and tp coordinates) a turn."""
    lay = parse_layout(layout, dist.get_world_size())
    mesh = build_mesh(lay, "cpu")  # collective over the world: before the turns
    if meta:
        return _set_up(cfg, mesh, zero, meta)
    rank = dist.get_rank()
    turn = rank // (lay.dp * lay.tp) * lay.tp + rank % lay.tp  # ranks are laid out (pp, dp, tp)
    result = {}
    for current in range(lay.pp * lay.tp):
        if current == turn:
            result = _set_up(cfg, mesh, zero, meta)
            gc.collect()
        dist.barrier()
    return result


def run(cfg: ModelConfig, layout: str, zero: int, meta: bool, world: int) -> dict:
    ranks = run_distributed(_rank, world, cfg, layout, zero, meta, timeout=3600, pg_timeout=1800)
    peaks = [r["peak_setup_bytes"] for r in ranks]
    shards = [r["shard_bytes"] for r in ranks]
    return {
        "layout": layout,
        "zero": zero,
        "path": "meta" if meta else "full",
        "tie_embeddings": cfg.tie_embeddings,
        "parameters": param_counts(cfg)["total"],
        "peak_setup_bytes_per_rank": peaks,
        "shard_bytes_per_rank": shards,
        "setup_s_per_rank": [r["setup_s"] for r in ranks],
        "within_goal": all(p <= 1.25 * s + 64 * MIB for p, s in zip(peaks, shards, strict=True)),
        "ranks": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-1b", help="model preset")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--runs", nargs="+", default=["dp=2,tp=2@3", "pp=2,tp=2@0"], help="LAYOUT@ZERO, one run each")
    parser.add_argument("--full", action="store_true", help="also measure the full-then-shard path")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    results = []
    for spec in args.runs:
        layout, _, zero = spec.partition("@")
        cfg = preset(args.model)
        if parse_layout(layout, args.world).pp > 1 and cfg.tie_embeddings:
            cfg = cfg.replace(tie_embeddings=False)
        for meta in (True, False) if args.full else (True,):
            results.append(run(cfg, layout, int(zero or 0), meta, args.world))
    if args.json:
        print(json.dumps({"model": args.model, "world": args.world, "goal": GOAL, "runs": results}, indent=1))
        return
    print(f"model {args.model}, world {args.world}; goal: {GOAL}\n")
    print("| layout | zero | path | rank | peak set-up (MiB) | shard (MiB) | peak / shard | set-up (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for res in results:
        for r in res["ranks"]:
            print(
                f"| {res['layout']} | {res['zero']} | {res['path']} | {r['rank']} | {r['peak_setup_bytes'] / MIB:,.0f} "
                f"| {r['shard_bytes'] / MIB:,.0f} | {r['peak_setup_bytes'] / r['shard_bytes']:.2f} | {r['setup_s']} |"
            )


if __name__ == "__main__":
    main()
