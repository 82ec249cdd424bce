"""Fused, chunked output projection + cross-entropy (`train.fused_loss`) vs the unfused head and loss, side by
side in one run: bytes saved for backward (meshlm.observe.memory.ActivationMeter: the unfused loss keeps the
fp32 log-softmax of every token, batch × seq × vocab; the fused one keeps the hidden-state and head-weight
gradients it computed in forward) and the median time of forward + backward, with the loss and gradients
compared. Prints a markdown table (docs/benchmarks.md).

    .venv/bin/python benchmarks/fused_loss.py                      # vocab 32k and 128k, 1024 tokens, ~1 min
    .venv/bin/python benchmarks/fused_loss.py --tokens 256 --vocab 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from meshlm.model import token_cross_entropy
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel.transforms.fused_loss import HeadOutput, fused_cross_entropy_sum


def measure(vocab: int, tokens: int, dim: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(dim, vocab, bias=False)
    nn.init.normal_(head.weight, std=0.02, generator=g)
    hidden = torch.randn(1, tokens, dim, generator=g)
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    targets[:, : tokens // 4] = -100  # a masked prompt

    def unfused(h: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(head(h), targets).sum()

    def fused(h: torch.Tensor) -> torch.Tensor:
        return fused_cross_entropy_sum(HeadOutput(h, head.weight), targets)

    out = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        times, saved = [], 0
        for _ in range(repeats):
            head.weight.grad = None
            h = hidden.clone().requires_grad_()
            meter = ActivationMeter(head)
            start = time.perf_counter()
            with meter:
                loss = fn(h)
            loss.backward()
            times.append(time.perf_counter() - start)
            saved = meter.peak
        out[name] = {"loss": loss.item(), "grad_h": h.grad, "grad_w": head.weight.grad.clone(), "saved": saved,
                     "s": statistics.median(times)}  # fmt: skip
    a, b = out["unfused"], out["fused"]
    err = max(
        abs(a["loss"] - b["loss"]) / abs(a["loss"]),
        ((a["grad_h"] - b["grad_h"]).abs().max() / a["grad_h"].abs().max()).item(),
        ((a["grad_w"] - b["grad_w"]).abs().max() / a["grad_w"].abs().max()).item(),
    )
    return {"vocab": vocab, "tokens": tokens, "dim": dim, "unfused": a, "fused": b, "err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| vocab | tokens × dim | saved MiB unfused | saved MiB fused | saved ratio | s unfused | s fused | "
          "time ratio | max rel. diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        r = measure(vocab, args.tokens, args.dim, args.repeats)
        u, f = r["unfused"], r["fused"]
        print(
            f"| {vocab:,} | {r['tokens']} × {r['dim']} | {u['saved'] / 2**20:.1f} | {f['saved'] / 2**20:.1f} | "
            f"{f['saved'] / u['saved']:.3f} | {u['s']:.3f} | {f['s']:.3f} | {f['s'] / u['s']:.2f} | {r['err']:.1e} |"
        )


if __name__ == "__main__":
    main()
