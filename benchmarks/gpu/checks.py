"""Correctness checks that need the GPU, run by benchmarks/gpu/check.sh after the benchmark (about a minute).

  fp8-numerics     torch._scaled_mm against the emulated fp8 matmul (same quantisation, so equal up to the
                   bf16 output rounding) and against the bf16 layer (within the fp8 bounds of
                   tests/parallel/test_fp8.py)
  device-guard     a NaN injected at step 3: with `train.sync_every > 1` the update is skipped on the device
                   (fused AdamW's found_inf) with no host sync in any step (torch.cuda sync debug mode "error"),
                   the losses equal the synced path's (which reads and skips on the host)
  bf16-gathers     ZeRO-3 at world 1 with `parallel.zero_param_dtype = auto`: bf16 working weights over fp32
                   masters, gathered and trained; losses within bf16 rounding of ZeRO-0's; bytes as the planner's
  cuda-defaults    what `meshlm train` resolves on CUDA: compile on, host syncs only at log/eval/checkpoint
                   steps, the device guard, fused AdamW
  grad-accum       two micro-batches on bf16 working weights (ZeRO-1, 2, 3; `auto` under bf16 autocast on
                   CUDA): parallel.grad_accum_dtype fp32 gives each micro-batch's gradient summed in fp32
                   (within one bf16 rounding of the final gradient, elementwise); bf16 visibly rounds the sum
  fused-loss       the fused loss under bf16 in 8 chunks: the head-weight gradient summed over chunks in fp32
                   (the GEMM's fp32 output, `bf16_gemm` says which), against the fp64 sum of the same operands

Each check prints PASS or FAIL with its figures; `--json FILE` writes them all. `--device cpu` runs what can run
on a CPU (the emulated parts, no sync debug mode) so tests/integration/test_gpu_benchmark.py keeps this script honest.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.config import TrainSection
from meshlm.model import ModelConfig, Transformer
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout

MODEL = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256, max_seq_len=64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_fp8(device: torch.device) -> dict:
    from meshlm.parallel.transforms.fp8 import check_fp8_device, fp8_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(device, torch.bfloat16)
    w = (0.02 * torch.randn(384, 512, generator=g)).to(device)
    dy = torch.randn(256, 384, generator=g).to(device, torch.bfloat16)
    out = {}
    grads = {}
    for name, emulate in (("real", False), ("emulated", True)):
        if name == "real" and device.type != "cuda":
            continue
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = fp8_linear(xi, wi, emulate=emulate)
        y.backward(dy)
        out[name], grads[name] = y, (xi.grad, wi.grad)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        yr = F.linear(xr, wr)
    yr.backward(dy)
    got = "real" if "real" in out else "emulated"
    figures = {
        "y_vs_bf16": rel(out[got], yr),
        "dx_vs_bf16": rel(grads[got][0], xr.grad),
        "dw_vs_bf16": rel(grads[got][1], wr.grad),
    }
    ok = figures["y_vs_bf16"] < 0.075 and figures["dx_vs_bf16"] < 0.12 and figures["dw_vs_bf16"] < 0.12
    if "real" in out:
        check_fp8_device(device)
        figures["y_real_vs_emulated"] = rel(out["real"], out["emulated"])
        figures["dw_real_vs_emulated"] = rel(grads["real"][1], grads["emulated"][1])
        ok &= figures["y_real_vs_emulated"] < 1e-2 and figures["dw_real_vs_emulated"] < 1e-2  # bf16 rounding
    return {"ok": ok, **figures}


def build(device: torch.device, parallel: dict) -> ParallelModel:
    mesh = build_mesh(parse_layout("", 1), device.type)
    with torch.device("meta"):
        model = Transformer(MODEL, init_seed=0)
    return parallelize(model, mesh, {**parallel, "autocast_dtype": "bf16" if device.type == "cuda" else None})


def batches(device: torch.device, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, MODEL.vocab_size, (4, 65), generator=g).to(device) for _ in range(n)]


def check_device_guard(device: torch.device) -> dict:
    from meshlm.train.guards import DeviceStepGuard, StepGuard
    from meshlm.train.optim import build_optimizer, device_train_step, train_step

    train = TrainSection(global_batch=4, warmup_steps=0)
    data = batches(device, 8)
    runs = {}
    for mode in ("synced", "device"):
        pm = build(device, {})
        opt = build_optimizer(pm, train, fused=True)
        host, guard = StepGuard("skip", 0.0), DeviceStepGuard(0.0, device)
        losses, verdicts, snapshot, step = [], [], None, [0]
        original = pm.forward_backward

        def poisoned(inputs: torch.Tensor, targets: torch.Tensor, pm=pm, original=original, step=step) -> torch.Tensor:
            loss = original(inputs, targets)
            if step[0] == 3:  # a NaN gradient at step 3, as tests/integration/test_guards.py injects it
                next(pm.chunks[0].parameters()).grad[0, 0] = float("nan")
            return loss

        pm.forward_backward = poisoned
        for i, tokens in enumerate(data, start=1):
            x, y = tokens[:, :-1], tokens[:, 1:]
            step[0] = i
            if i == 3:
                snapshot = {n: p.detach().clone() for n, p in pm.named_parameters()}
            if mode == "synced":
                loss, _, applied = train_step(pm, opt, x, y, 1e-3, 1.0, host.allow)
                losses.append(loss)
                verdicts.append(applied)
            else:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    loss, _, applied = device_train_step(pm, opt, x, y, 1e-3, 1.0, guard.allow)
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
                losses.append(loss)
                verdicts.append(applied)
            if i == 3:
                unchanged = all(torch.equal(p, snapshot[n]) for n, p in pm.named_parameters())
        if mode == "device":
            losses = torch.stack(losses).tolist()
            verdicts = [bool(v) for v in torch.stack(verdicts).tolist()]
        runs[mode] = {"losses": losses, "verdicts": verdicts, "step3_unchanged": unchanged}
    a, b = runs["synced"]["losses"], runs["device"]["losses"]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    skipped = [[i + 1 for i, v in enumerate(r["verdicts"]) if not v] for r in runs.values()]
    # 1e-5: the same kernels in the same order; only the embedding's atomic gradient sums may reorder on a GPU.
    ok = skipped == [[3], [3]] and all(r["step3_unchanged"] for r in runs.values()) and worst <= 1e-5
    ok &= all(math.isfinite(x) for x in b)
    return {"ok": ok, "skipped": skipped, "max_rel_loss_diff": worst, "losses_device": b}


def check_bf16_gathers(device: torch.device) -> dict:
    from meshlm.plan.memory import model_state_bytes
    from meshlm.train.optim import build_optimizer, train_step

    train = TrainSection(global_batch=4, warmup_steps=0)
    data = batches(device, 6)
    losses, figures = {}, {}
    for zero in (0, 3):
        pm = build(device, {"zero": zero})
        opt = build_optimizer(pm, train, fused=device.type == "cuda")
        losses[zero] = [train_step(pm, opt, t[:, :-1], t[:, 1:], 1e-3, 1.0)[0] for t in data]
        if zero == 3:
            figures["working_dtype"] = str(pm.dp.param_dtype)
            figures["master_dtype"] = str(pm.dp.buffers[0].master.dtype)
            held = pm.dp.memory_report(opt)
            psi = sum(p.numel() for p in Transformer(MODEL).parameters())
            precision = "bf16" if pm.dp.param_dtype == torch.bfloat16 else "fp32"
            planned = dict(zip(("params", "grads", "optimizer"), model_state_bytes(psi, 1, 3, precision), strict=True))
            figures["bytes_vs_planner"] = {k: held[k] / planned[k] for k in ("params", "optimizer")}
    worst = max(abs(a - b) / a for a, b in zip(losses[0], losses[3], strict=True))
    figures["max_rel_loss_diff_zero3_vs_zero0"] = worst
    want = "torch.bfloat16" if device.type == "cuda" else "torch.float32"
    # 2%: bf16 weights round each parameter by ≤ 2^-9 relative; over 6 steps the loss moves far less.
    ok = figures["working_dtype"] == want and figures["master_dtype"] == "torch.float32" and worst < 0.02
    ok &= all(abs(r - 1) < 0.05 for r in figures["bytes_vs_planner"].values())
    return {"ok": ok, **figures}


def check_cuda_defaults(device: torch.device) -> dict:
    import tempfile

    from meshlm.config import Config
    from meshlm.parallel.transforms import compile as compile_module
    from meshlm.train import trainer as trainer_module

    seen = {}

    def capture(self: trainer_module.Trainer) -> trainer_module.TrainResult:
        opt = self.optimizer.defaults
        seen.update(sync_every=self.sync_every, device_guard=self.device_guard is not None, fused=bool(opt["fused"]))
        return self.result

    original = trainer_module.Trainer.run
    trainer_module.Trainer.run = capture
    compiled = []
    original_compile = compile_module.compile_blocks
    compile_module.compile_blocks = lambda chunks, plan, backend: compiled.append(backend) or 0
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = Config.model_validate(
                {
                    "model": {"preset": "test"},
                    "data": {"seq_len": 64},
                    "train": {"steps": 2, "global_batch": 4, "eval_every": 0, "device": device.type},
                    "log": {"run_dir": run_dir, "tensorboard": False, "progress": False},
                }
            )
            data = [(t[:, :-1].cpu(), t[:, 1:].cpu()) for t in batches(torch.device("cpu"), 2)]
            trainer_module.fit(cfg, data=data)
    finally:
        trainer_module.Trainer.run = original
        compile_module.compile_blocks = original_compile
    seen["compiled"] = bool(compiled)
    cuda = device.type == "cuda"
    want = {"sync_every": 0 if cuda else 1, "device_guard": cuda, "fused": cuda, "compiled": cuda}
    return {"ok": seen == want, **seen}


def check_grad_accum(device: torch.device) -> dict:
    from meshlm.check.worker import CopyGradient

    tokens = batches(device, 1)[0]
    x, y = tokens[:, :-1], tokens[:, 1:]
    working = "auto" if device.type == "cuda" else "bf16"  # on CUDA what runs by default; the CPU forces it

    def final_grads(parallel: dict, rows: slice) -> dict[str, torch.Tensor]:
        """The reduced gradient of one step over `rows`, copied into the fp32 masters and gathered."""
        pm = build(device, {"zero_param_dtype": working, **parallel})
        pm.forward_backward(x[rows], y[rows])
        pm.step(CopyGradient(pm.optimizer_param_groups(0.0)))
        return {k: v.double() for k, v in pm.full_state_dict().items()}

    # Each micro-batch alone, one micro-batch per step: the same bf16 gradients the accumulating runs compute
    # (same weights, rows and kernels), at twice their loss scale (the step's tokens are half): exact in binary.
    halves = [final_grads({"zero": 1}, rows) for rows in (slice(0, 2), slice(2, 4))]
    ref = {k: (halves[0][k] + halves[1][k]) / 2 for k in halves[0]}
    size = {k: (halves[0][k].abs() + halves[1][k].abs()) / 2 for k in halves[0]}
    figures, ok = {}, True
    for zero in (1, 2, 3):
        for accum in ("fp32", "bf16"):
            got = final_grads({"zero": zero, "micro_batches": 2, "grad_accum_dtype": accum}, slice(0, 4))
            # one bf16 rounding of the final gradient (u = 2^-8), plus the fp32 sum's bound on 2 terms
            bad = sum(int(((got[k] - ref[k]).abs() > 2**-8 * ref[k].abs() + 3 * 2**-24 * size[k]).sum()) for k in ref)
            error = sum(float((got[k] - ref[k]).square().sum()) for k in ref) ** 0.5
            norm = sum(float(ref[k].square().sum()) for k in ref) ** 0.5
            figures[f"zero{zero}_{accum}"] = {"outside_bound": bad, "rel_error": error / norm}
            # float32: no element outside; bfloat16 rounds the two-term sum once (≈ 2^-9 relative in norm)
            ok &= (bad == 0 and error / norm < 1e-6) if accum == "fp32" else error / norm > 1e-4
    figures["elements"] = sum(t.numel() for t in ref.values())
    return {"ok": ok, **figures}


def check_fused_loss(device: torch.device) -> dict:
    """The fused loss under bf16 autocast in 8 chunks: its head-weight gradient is the sum of the chunks'
    products of the very bf16 operands it used (recorded), taken in fp64, to fp32 accumulation (< 1e-5
    relative; a bf16 rounding of each chunk's partial is ~1e-3). CPU: fp32, as its bf16 runs one chunk."""
    from meshlm.parallel.transforms import fused_loss

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens, vocab, dim = 2048, 4096, 128
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, dim, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab, dim, generator=g)).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    grads: list[torch.Tensor] = []
    original, budget = fused_loss._softmax_grad, fused_loss.CHUNK_BYTES

    def recorded(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grad = original(*args)
        grads.append(grad)
        return loss, grad

    fused_loss._softmax_grad, fused_loss.CHUNK_BYTES = recorded, 4 * vocab * tokens // 8
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            fused_loss.fused_cross_entropy_sum(fused_loss.HeadOutput(hidden, weight), targets).backward()
    finally:
        fused_loss._softmax_grad, fused_loss.CHUNK_BYTES = original, budget
    chunks = hidden.detach()[0].to(dtype).double().split(grads[0].shape[0])
    want = sum(gr.double().t() @ hc for gr, hc in zip(grads, chunks, strict=True))
    err = ((weight.grad.double() - want).norm() / want.norm()).item()
    gemm = fused_loss._fp32_output_gemm(device, torch.bfloat16)
    return {"ok": len(grads) == 8 and err < 1e-5, "chunks": len(grads), "rel_err_vs_fp64": err, "bf16_gemm": gemm}


CHECKS: dict[str, Callable[[torch.device], dict]] = {
    "fp8-numerics": check_fp8,
    "device-guard": check_device_guard,
    "bf16-gathers": check_bf16_gathers,
    "cuda-defaults": check_cuda_defaults,
    "grad-accum": check_grad_accum,
    "fused-loss": check_fused_loss,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="comma-separated check names")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu/checks.py checks GPU code paths; nothing to run here")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for name, check in CHECKS.items():
        if args.only and name not in args.only.split(","):
            continue
        began = time.perf_counter()
        created = not dist.is_initialized() and name != "cuda-defaults"
        if created:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            results[name] = check(device)
        except Exception as e:  # a check that crashes is a failed check, with its cause; the others still run
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        finally:
            if created and dist.is_initialized():
                dist.destroy_process_group()
        results[name]["seconds"] = round(time.perf_counter() - began, 1)
        shown = {k: v for k, v in results[name].items() if k not in ("ok", "trace", "losses_device")}
        print(f"{'PASS' if results[name]['ok'] else 'FAIL'} {name}: {json.dumps(shown, default=str)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
