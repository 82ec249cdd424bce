"""Activation recompute (`train.recompute`): saved activation bytes per layer and step time for none,
selective, mlp and full, measured side by side and set against the planner's per-layer formula
(meshlm.plan.memory.layer_activation_bytes), with the SDPA flash kernel (CPU default) and the math kernel
(what runs where no flash kernel applies: there selective drops the stored softmax probabilities).

One layer's bytes are the ActivationMeter peak of an (L+1)-layer model minus an L-layer one (the embedding,
logits and loss cancel). Step time is the median of forward + backward over the same batches, policies
taking turns. Prints a markdown table.

    .venv/bin/python benchmarks/recompute.py                       # tiny preset, seq 256, ~1 minute
    .venv/bin/python benchmarks/recompute.py --model test --seq-len 64
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlm.model import ModelConfig, Transformer, cross_entropy_loss, preset
from meshlm.model.llama import set_recompute
from meshlm.observe.memory import ActivationMeter
from meshlm.plan.memory import layer_activation_bytes

POLICIES = ("none", "selective", "mlp", "full")


def saved_bytes(cfg: ModelConfig, policy: str, x: torch.Tensor) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg)
    set_recompute(model, policy)
    with ActivationMeter(model) as meter:
        loss = cross_entropy_loss(model(x), x)
    loss.backward()
    return meter.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cfg = preset(args.model)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    print(f"model {args.model}, batch {args.batch}×{args.seq_len}, fp32, {args.steps} timed steps per policy\n")
    print("| kernel | recompute | measured KiB / layer | planner KiB / layer | planner / measured | median step (ms) |")
    print("|---|---|---|---|---|---|")
    for flash in (True, False):
        kernel = contextlib.nullcontext() if flash else sdpa_kernel(SDPBackend.MATH)
        with kernel:
            models = {}
            for policy in POLICIES:
                torch.manual_seed(0)
                models[policy] = Transformer(cfg)
                set_recompute(models[policy], policy)
            times: dict[str, list[float]] = {p: [] for p in POLICIES}
            for step in range(args.steps):
                for policy in POLICIES if step % 2 == 0 else reversed(POLICIES):
                    start = time.perf_counter()
                    cross_entropy_loss(models[policy](x), x).backward()
                    times[policy].append(time.perf_counter() - start)
            for policy in POLICIES:
                deeper = cfg.replace(n_layers=cfg.n_layers + 1)
                measured = saved_bytes(deeper, policy, x) - saved_bytes(cfg, policy, x)
                planned = layer_activation_bytes(cfg, args.seq_len, args.batch, 1, False, policy, "fp32", flash)
                print(
                    f"| {'flash' if flash else 'math'} | {policy} | {measured / 1024:.1f} | {planned / 1024:.1f} "
                    f"| {planned / measured:.3f} | {statistics.median(times[policy]) * 1e3:.1f} |"
                )


if __name__ == "__main__":
    main()
