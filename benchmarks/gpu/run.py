"""On one CUDA GPU: llama3-1b-shaped training at world 1, meshlm beside FSDP2, eager and compiled, a batch sweep,
FP8, and the full `meshlm train` loop; prints a markdown table and the meshlm / FSDP2 ratios.

Every row runs in its own subprocess under its own time limit (a hang or a crash costs that row only) and the
whole run stops starting rows once `--budget-s` is spent (default 300 s: about 5 minutes on an H100/H200).
Each row builds the model (same init seed), trains `--warmup` untimed steps (compilation happens there), then
up to `--steps` timed ones on the same random batches, reading the loss once per `--every` steps; tokens/s is
over the timed window (one device sync at each end), MFU is model FLOPs (meshlm.model.flops) over the GPU's
datasheet bf16 peak (meshlm.observe.peak), peak memory is the row's own (a fresh process each).

Rows (`--rows` picks some, by name):
  meshlm-eager / meshlm-compiled   ParallelModel as `meshlm train` builds it (bf16 autocast, fused AdamW,
                                   per-block torch.compile when compiled, no host sync per step)
  fsdp2-eager / fsdp2-compiled     the torchtitan recipe: per-block torch.compile, then per-block and root
                                   `fully_shard` with MixedPrecisionPolicy(bf16 params, fp32 reduction), fused
                                   AdamW, foreach clipping
  *-b8 / *-s8k                     the batch sweep: 8×2048 and 1×8192
  meshlm-fp8                       compiled meshlm with `train.fp8` (FP8 Linear layers in the blocks), 8×2048
  train-loop                       `meshlm.fit` with every built-in (prefetching data loader, logging, guards)
                                   and no performance flag, 8×2048; tokens/s from its own step metrics

Without a CUDA device it prints "no CUDA device" and exits 0 (tests/integration/test_gpu_benchmark.py runs every row's
code on the CPU with `--device cpu` instead).

    python benchmarks/gpu/run.py
    python benchmarks/gpu/run.py --rows meshlm-compiled,fsdp2-compiled --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Row:
    system: str  # meshlm | fsdp2 | train-loop
    compiled: bool
    batch: int  # rows per data-parallel replica
    seq_len: int
    fp8: bool = False
    limit_s: float = 60.0  # this row's own time limit (compilation included)
    fused_loss: bool = True  # meshlm: train.fused_loss, on as `meshlm train` has it
    layout: str = ""  # meshlm on several GPUs (torchrun): the mesh layout
    options: tuple[tuple[str, object], ...] = ()  # and its parallel options
    moe: bool = False  # the model with experts (expert parallel)
    gpus: int = 1  # the GPUs the row needs: skipped with a line when fewer are visible


def rows_for(batch: int, seq_len: int, world: int = 1) -> dict[str, Row]:
    """Every row, in the order they run (most wanted first: later ones are dropped when the budget runs out).
    The rows of several GPUs use all `world` visible ones (their layouts say how)."""
    b8, s8k = (2 * batch, seq_len), (1, 4 * seq_len)
    w = max(world, 2)
    several = {"limit_s": 90, "gpus": 2}
    hsdp = (("zero", 3), ("zero_shard_size", w // 2))  # shard within halves, replicate across them
    return {
        "meshlm-compiled": Row("meshlm", True, batch, seq_len, limit_s=90),
        "fsdp2-compiled": Row("fsdp2", True, batch, seq_len, limit_s=90),
        "meshlm-compiled-b8": Row("meshlm", True, *b8, limit_s=50),
        "meshlm-compiled-b8-unfused": Row("meshlm", True, *b8, fused_loss=False, limit_s=50),
        "fsdp2-compiled-b8": Row("fsdp2", True, *b8, limit_s=50),
        "meshlm-fp8": Row("meshlm", True, *b8, fp8=True, limit_s=75),
        "train-loop": Row("train-loop", False, *b8, limit_s=75),
        "meshlm-eager": Row("meshlm", False, batch, seq_len, limit_s=35),
        "fsdp2-eager": Row("fsdp2", False, batch, seq_len, limit_s=35),
        "meshlm-compiled-s8k": Row("meshlm", True, *s8k, limit_s=45),
        "fsdp2-compiled-s8k": Row("fsdp2", True, *s8k, limit_s=45),
        "zero1": Row("meshlm", True, batch, seq_len, layout=f"dp={w}", options=(("zero", 1),), **several),
        "zero3": Row("meshlm", True, batch, seq_len, layout=f"dp={w}", options=(("zero", 3),), **several),
        "hsdp": Row("meshlm", True, batch, seq_len, layout=f"dp={w}", options=hsdp, limit_s=90, gpus=4),
        "cp": Row("meshlm", True, batch, seq_len, layout=f"dp={w // 2},cp=2", **several),
        "ep": Row("meshlm", True, batch, seq_len, layout=f"ep={w}", moe=True, **several),
    }


def with_experts(cfg):
    """`cfg` with 8 routed experts, 2 per token, each a quarter of the dense MLP wide (the expert-parallel row)."""
    return cfg.replace(n_experts=8, top_k=2, moe_intermediate_size=cfg.intermediate_size // 4, hf_model_type="mixtral")


# ---- the systems ----------------------------------------------------------------------------------------------
def meshlm_system(cfg, row: Row, device: torch.device, backend: str, emulate_fp8: bool = False) -> Step:
    """meshlm's hot path as the trainer runs it on CUDA (meshlm.train.startup): meta build materialised on the
    device, the loss fused with the head (train.fused_loss, on by default) unless the row turns it off, fused
    AdamW, optional FP8 swap and per-block compile, `device_train_step` (no host sync); on the row's layout
    over every rank (each feeding its replica's rows of the global batch), or at world 1."""
    from meshlm.config import TrainSection
    from meshlm.model import Transformer
    from meshlm.parallel.engine import parallelize
    from meshlm.parallel.mesh import build_mesh, parse_layout
    from meshlm.parallel.options import Loss
    from meshlm.train.optim import build_optimizer, device_train_step

    train = TrainSection(global_batch=row.batch, warmup_steps=0)
    mesh = build_mesh(parse_layout(row.layout, dist.get_world_size()), device.type)
    with torch.device("meta"):
        model = Transformer(with_experts(cfg) if row.moe else cfg, init_seed=0)
    autocast = "bf16" if device.type == "cuda" else None
    fp8 = ("emulate" if emulate_fp8 else True) if row.fp8 else False
    options = {"autocast_dtype": autocast, "fp8": fp8, "compile": row.compiled, "compile_backend": backend}
    loss = Loss(ignore_index=train.ignore_index, fused=train.fused_loss and row.fused_loss)
    pm = parallelize(model, mesh, {**options, **dict(row.options)}, loss=loss)
    opt = build_optimizer(pm, train, fused=device.type == "cuda")
    return lambda x, y: device_train_step(pm, opt, pm.local_batch(x), pm.local_batch(y), train.lr, train.grad_clip)[0]


def build_on(cfg, device: torch.device):
    """meshlm's Transformer with real weights on `device`: built on meta, then allocated there and filled by
    its own init (which draws on CPU generators, so it cannot run under `with torch.device('cuda')`)."""
    from meshlm.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg, init_seed=0)
    tables = {name: b.to(device) for name, b in model.named_buffers()}  # rotary tables: real even on meta
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own new Parameter: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, b in tables.items():
        model.get_buffer(name).copy_(b)
    model.reset_parameters()
    return model


def fsdp2_system(cfg, row: Row, device: torch.device, backend: str) -> Step:
    """The torchtitan recipe at world 1: per-block compile, fully_shard per block and at the root with bf16
    parameters and fp32 reduction, fused AdamW (matrices decay), foreach clipping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from meshlm.config import TrainSection
    from meshlm.model import cross_entropy_loss

    train = TrainSection(global_batch=row.batch, warmup_steps=0)
    model = build_on(cfg, device)
    if row.compiled:
        for block in model.model.layers.values():
            block.compile(backend=backend)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, **fused)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ---- one row, in this process -----------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    """This process's peak memory: on CUDA what torch allocated at most; on the CPU (the dry run, where torch's
    allocator is malloc) the resident set's high-water mark since exec (VmHWM; getrusage's ru_maxrss would
    carry the parent's over) — each row is a fresh process, so it is the row's."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # KiB


def measure(step: Step, batches: list[torch.Tensor], args: argparse.Namespace, device: torch.device) -> dict:
    """Warm-up steps, then timed ones until `--steps` or the row's deadline; losses read once per `--every`."""
    pending: list[torch.Tensor] = []
    losses: list[float] = []

    def run(tokens: torch.Tensor) -> None:
        pending.append(step(tokens[:, :-1], tokens[:, 1:]))
        if len(pending) == args.every:
            losses.extend(torch.stack(pending).float().tolist())
            pending.clear()

    for tokens in batches[: args.warmup]:
        run(tokens)
    synchronize(device)
    deadline = time.perf_counter() + args.timed_s
    start, timed = time.perf_counter(), 0
    for tokens in batches[args.warmup :]:
        run(tokens)
        timed += 1
        if time.perf_counter() > deadline:
            break
    synchronize(device)
    elapsed = time.perf_counter() - start
    if pending:
        losses.extend(torch.stack(pending).float().tolist())
    tokens = batches[0].shape[0] * (batches[0].shape[1] - 1)
    return {"steps": timed, "tokens_per_s": timed * tokens / elapsed, "final_loss": losses[-1]}


class _Done(Exception):
    """Raised by the train-loop row's callback after its last timed step (so no final checkpoint is written)."""


def train_loop_row(row: Row, args: argparse.Namespace, device: torch.device) -> dict:
    """`meshlm.fit` with meshlm's own model, loop, loader, logging and guards, and no performance flag; tokens/s
    is the loop's own step metric over the windows after the warm-up."""
    from meshlm.config import Config
    from meshlm.train.parts import Callback
    from meshlm.train.trainer import fit

    every = 5
    warm = max(every, -(-args.warmup // every) * every)
    total = warm + max(every, args.steps // every * every)
    g = torch.Generator().manual_seed(0)
    data = [
        (t[:, :-1], t[:, 1:])
        for t in (torch.randint(0, args.cfg.vocab_size, (row.batch, row.seq_len + 1), generator=g) for _ in range(4))
    ]
    windows: list[float] = []

    class Record(Callback):
        def on_step_end(self, trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
            if step > warm and step % every == 0:
                windows.append(metrics["tokens_per_s"])
            if step == total:
                raise _Done

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = Config.model_validate(
            {
                "model": {"preset": args.model, **args.shape},
                "data": {"seq_len": row.seq_len},
                "train": {"steps": total, "global_batch": row.batch, "eval_every": 0, "device": device.type}
                | ({} if device.type == "cuda" else {"compile": row.compiled, "compile_backend": args.backend}),
                "checkpoint": {"every": 0, "async_save": False},
                "log": {"run_dir": run_dir, "every": every, "tensorboard": False, "progress": False},
            }
        )
        with contextlib.suppress(_Done):
            fit(cfg, data=data, callbacks=[Record()])
    return {"steps": total - warm, "tokens_per_s": sum(windows) / len(windows), "final_loss": float("nan")}


def run_row(name: str, row: Row, args: argparse.Namespace) -> dict:
    """One row in this process (a rank of torchrun's for a row of several GPUs: rank 0 reports)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    if row.system == "train-loop":
        result = train_loop_row(row, args, device)
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        bound = {"device_id": device} if device.type == "cuda" else {}
        if world > 1:  # torchrun's environment
            dist.init_process_group(backend, **bound)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bound)
        try:
            from meshlm.parallel.mesh import parse_layout

            layout = parse_layout(row.layout, world)
            g = torch.Generator().manual_seed(0)
            shape = (row.batch * layout.dp * layout.ep, row.seq_len + 1)  # the global batch: each replica's rows
            batches = [
                torch.randint(0, args.cfg.vocab_size, shape, generator=g).to(device)
                for _ in range(args.warmup + args.steps)
            ]
            if row.system == "meshlm":
                step = meshlm_system(args.cfg, row, device, args.backend, emulate_fp8=device.type != "cuda")
            else:
                step = fsdp2_system(args.cfg, row, device, args.backend)
            result = measure(step, batches, args, device)
        finally:
            dist.destroy_process_group()
            gc.collect()
    return {"name": name, **vars(row), **result, "peak_gib": peak_gib(device), "world": world}


# ---- the table ----------------------------------------------------------------------------------------------------
def table(results: list[dict], args: argparse.Namespace) -> str:
    from meshlm.model import flops_per_token
    from meshlm.observe.peak import mfu_basis, peak_flops

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    peak = peak_flops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    memory = "allocated" if device.type == "cuda" else "RSS high-water"
    lines = [
        f"{name}, torch {torch.__version__}, {args.model}, {args.world} visible\n",
        f"| row | layout | batch | compiled | loss | timed steps | tokens/s | MFU (of {mfu_basis(device.type, name)}) "
        f"| peak GiB ({memory}, rank 0) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {r["name"]: r for r in results}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | | | | | {r['error']} | | |")
            continue
        cfg = with_experts(args.cfg) if r.get("moe") else args.cfg
        mfu = r["tokens_per_s"] * flops_per_token(cfg, r["seq_len"]) / (peak * r.get("world", 1))
        loss = "-" if r["system"] != "meshlm" else "fused" if r["fused_loss"] else "unfused"
        lines.append(
            f"| {r['name']} | {r.get('layout') or 'world 1'} | {r['batch']}×{r['seq_len']} "
            f"| {'per block' if r['compiled'] else 'eager'} | {loss} | {r['steps']} | {r['tokens_per_s']:,.0f} "
            f"| {mfu:.1%} | {r['peak_gib']:.2f} |"
        )
    lines.append("")
    for mine, theirs in [
        (n, n.replace("meshlm", "fsdp2")) for n in by_name if n.startswith("meshlm-") and "unfused" not in n
    ]:
        a, b = by_name.get(mine), by_name.get(theirs)
        if a and b and "error" not in a and "error" not in b:
            lines.append(
                f"{mine} / {theirs}: tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.3f}, "
                f"peak memory {a['peak_gib'] / max(b['peak_gib'], 1e-9):.3f}"
            )
    for num, den in [("meshlm-fp8", "meshlm-compiled-b8"), ("train-loop", "meshlm-compiled-b8")]:
        a, b = by_name.get(num), by_name.get(den)
        if a and b and "error" not in a and "error" not in b:
            lines.append(f"{num} / {den}: tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.3f}")
    a, b = by_name.get("meshlm-compiled-b8"), by_name.get("meshlm-compiled-b8-unfused")
    if a and b and "error" not in a and "error" not in b:  # the fused loss (the default) against no fusion
        lines.append(
            f"fused loss / unfused (meshlm-compiled-b8 / meshlm-compiled-b8-unfused): tokens/s "
            f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}, peak memory {a['peak_gib'] / max(b['peak_gib'], 1e-9):.3f}"
        )
    return "\n".join(lines)


def run_child(name: str, row: Row, args: argparse.Namespace, limit_s: float, env: dict[str, str]) -> dict:
    """One row in a child process (torchrun's ranks below it for a row of several GPUs), a session of its own:
    past `limit_s` the whole process group is killed, no rank left holding a GPU."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--row", name, "--json", out.name, *args.passthrough]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"name": name, "error": f"timed out after {limit_s:.0f} s"}
        if proc.returncode == 0:
            return json.loads(Path(out.name).read_text())
        tail = (stderr.strip().splitlines() or ["?"])[-1][:120]
        return {"name": name, "error": f"failed: {tail}"}


def run_all(args: argparse.Namespace, rows: dict[str, Row]) -> list[dict]:
    """Each row in a subprocess of this script, within min(its limit, what is left of the budget)."""
    began = time.perf_counter()
    results = []
    cache = Path(tempfile.gettempdir()) / "meshlm-gpu-bench-inductor"  # rows of one shape share compiled graphs
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(cache))}
    for name, row in rows.items():
        left = args.budget_s - (time.perf_counter() - began)
        if row.gpus > args.world:
            results.append({"name": name, "error": f"skipped: needs {row.gpus} GPUs, {args.world} visible"})
        elif left < min(row.limit_s, 20):
            results.append({"name": name, "error": "skipped: out of budget"})
        else:
            results.append(run_child(name, row, args, min(row.limit_s, left), env))
        print(f"[{time.perf_counter() - began:5.0f} s] {name}: {results[-1].get('error', 'done')}", flush=True)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-1b")
    parser.add_argument("--shape", default="{}", help="JSON of model fields overriding the preset (tests)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=10, help="read losses every N steps")
    parser.add_argument("--timed-s", type=float, default=10.0, help="stop a row's timing after this long")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no row past this")
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager in CPU tests)")
    parser.add_argument("--world", type=int, default=0, help="GPUs for the rows of several (default: all; CPU: 2)")
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from meshlm.model import preset

    args.shape = json.loads(args.shape)
    args.cfg = preset(args.model).replace(**args.shape) if args.shape else preset(args.model)
    if not args.world:
        args.world = (torch.cuda.device_count() or 1) if args.device == "cuda" else 2
    keep = ("--model", "--shape", "--batch", "--seq-len", "--warmup", "--steps", "--every", "--timed-s", "--device",
            "--backend", "--world")  # fmt: skip
    raw = sys.argv[1:] if argv is None else argv
    args.passthrough = [a for i, a in enumerate(raw) if a in keep or (i and raw[i - 1] in keep)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu/run.py measures GPU training; nothing to run here")
        return 0
    rows = rows_for(args.batch, args.seq_len, args.world)
    if args.row:  # a child: one row, its result as JSON (rank 0's)
        row = rows[args.row]
        if row.gpus > 1 and "LOCAL_RANK" not in os.environ:  # its ranks, under torchrun
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}"]
            return subprocess.run([*run, __file__, *sys.argv[1:]]).returncode
        result = run_row(args.row, row, args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.json).write_text(json.dumps(result))
        return 0
    chosen = [n.strip() for n in args.rows.split(",") if n.strip()] or list(rows)
    unknown = sorted(set(chosen) - set(rows))
    if unknown:
        print(f"--rows: unknown {', '.join(unknown)}; valid: {', '.join(rows)}")
        return 2
    results = run_all(args, {n: rows[n] for n in chosen})
    print()
    print(table(results, args))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
