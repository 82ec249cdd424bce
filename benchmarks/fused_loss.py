"""Fused, chunked output projection + cross-entropy (`train.fused_loss`, the default) vs the unfused head and loss,
side by side: time and peak memory of the head + loss forward and backward under bf16 autocast (as a real run),
at 32k and 128k vocabularies, with the ratios. Prints a markdown table (docs/benchmarks.md).

Time: both paths in this one process, alternating (unfused, fused, fused, unfused, ...), the median of
`--repeats` after one untimed warm-up each; ratio = unfused s / fused s (≥ 1: the fused loss is not slower).
Wall-clock seconds, and the process's CPU seconds (`time.process_time`, all threads): on a shared machine the
wall clock also counts waiting for a core, the CPU time only the work, so its ratio is the steadier one.
Peak memory: on CUDA `torch.cuda.max_memory_allocated` over one step, less what was allocated before it, in
this process. On the CPU torch's allocator is malloc (tracemalloc does not see it), so each path runs once in
a fresh subprocess of this script, which reads its resident set before the step (/proc/self/statm: the inputs
and weight allocated, nothing run) and its high-water mark after (VmHWM of /proc/self/status, the peak of this
process's own address space — not getrusage's ru_maxrss, which Linux carries over from the parent's at exec);
the peak is the difference, what the step added at its fullest. Ratio = fused MiB / unfused MiB (≤ 1: at least
as light).

    .venv/bin/python benchmarks/fused_loss.py                     # 32k and 128k, 2048 tokens × 512, ~75 s quiet
    .venv/bin/python benchmarks/fused_loss.py --vocab 8192 --tokens 256 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from meshlm.model import token_cross_entropy
from meshlm.parallel.transforms.fused_loss import HeadOutput, fused_cross_entropy_sum, tokens_per_chunk

PATHS = ("unfused", "fused")


def inputs(vocab: int, tokens: int, dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(vocab, dim, generator=g)).to(device)
    hidden = torch.randn(1, tokens, dim, generator=g).to(device)
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    targets[:, : tokens // 4] = -100  # a masked prompt
    return weight, hidden, targets.to(device)


def step_fn(path: str, weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> Callable[[], dict]:
    """One forward + backward of the head and loss under bf16 autocast; returns the loss and gradients."""

    def step() -> dict:
        w, h = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
        with torch.autocast(h.device.type, dtype=torch.bfloat16):
            if path == "unfused":
                loss = token_cross_entropy(h @ w.t(), targets).sum()
            else:
                loss = fused_cross_entropy_sum(HeadOutput(h, w), targets)
        loss.backward()
        return {"loss": loss.detach(), "grad_h": h.grad, "grad_w": w.grad}

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def high_water_bytes() -> int:
    """This process's peak resident set since its exec (VmHWM, in KiB in /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_child(path: str, vocab: int, tokens: int, dim: int) -> int:
    """In a fresh process (this script with --peak): the bytes one step of `path` adds at its fullest."""
    step_fn(path, *inputs(64, 8, 8, torch.device("cpu")))()  # torch's one-time set-up (thread pools, oneDNN)
    weight, hidden, targets = inputs(vocab, tokens, dim, torch.device("cpu"))
    before = rss_bytes()
    step_fn(path, weight, hidden, targets)()
    return high_water_bytes() - before


def peak_bytes(path: str, vocab: int, tokens: int, dim: int, device: torch.device, step: Callable[[], dict]) -> int:
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    cmd = [sys.executable, __file__, "--peak", path, "--vocab", str(vocab), "--tokens", str(tokens), "--dim", str(dim)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def measure(vocab: int, tokens: int, dim: int, repeats: int, device: torch.device) -> dict:
    weight, hidden, targets = inputs(vocab, tokens, dim, device)
    steps = {path: step_fn(path, weight, hidden, targets) for path in PATHS}
    results = {path: steps[path]() for path in PATHS}  # warm-up, and the values compared
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    cpu: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(repeats):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[path]()
            sync(device)
            times[path].append(time.perf_counter() - start)
            cpu[path].append(time.process_time() - start_cpu)
    peaks = {path: peak_bytes(path, vocab, tokens, dim, device, steps[path]) for path in PATHS}
    a, b = results["unfused"], results["fused"]
    diff = {k: ((a[k].float() - b[k].float()).norm() / a[k].float().norm()).item() for k in a}
    return {
        "vocab": vocab,
        "tokens": tokens,
        "dim": dim,
        "chunk_tokens": tokens_per_chunk(tokens, vocab, device, torch.bfloat16),
        "s": {path: statistics.median(t) for path, t in times.items()},
        "cpu_s": {path: statistics.median(t) for path, t in cpu.items()},
        "peak": peaks,
        "diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--peak", choices=PATHS, help=argparse.SUPPRESS)  # a child measuring one path's peak
    args = parser.parse_args()
    if args.peak:
        print(json.dumps({"peak": peak_child(args.peak, args.vocab[0], args.tokens, args.dim)}))
        return
    device = torch.device(args.device)
    print(f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 autocast, "
          f"load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| vocab | tokens × dim | fused chunk (tokens) | s unfused | s fused | speed ratio | CPU s unfused | "
          "CPU s fused | CPU-time ratio | peak MiB unfused | peak MiB fused | memory ratio | "
          "rel. diff loss / grad_h / grad_w |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        r = measure(vocab, args.tokens, args.dim, args.repeats, device)
        s, c, p, d = r["s"], r["cpu_s"], r["peak"], r["diff"]
        print(
            f"| {vocab:,} | {r['tokens']} × {r['dim']} | {r['chunk_tokens']} | {s['unfused']:.2f} | {s['fused']:.2f} "
            f"| {s['unfused'] / s['fused']:.2f} | {c['unfused']:.2f} | {c['fused']:.2f} "
            f"| {c['unfused'] / c['fused']:.2f} "
            f"| {p['unfused'] / 2**20:,.0f} | {p['fused'] / 2**20:,.0f} "
            f"| {p['fused'] / p['unfused']:.2f} | {d['loss']:.0e} / {d['grad_h']:.0e} / {d['grad_w']:.0e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
