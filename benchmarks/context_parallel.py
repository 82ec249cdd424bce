"""Activation memory per rank against sequence length under context parallel (cp = 1, 2, 4; ring and
Ulysses), measured beside the planner's prediction.

Measured: the peak bytes autograd holds saved for backward during one forward of a batch of one sequence
(meshlm.observe.ActivationMeter; parameters excluded), max over the cp ranks. Predicted: meshlm.plan.memory's
per-layer formula (layer_activation_bytes, with cp) × layers, plus the loss buffers (logits_bytes), fp32.
Each cp > 1 row also prints its ratio to cp = 1 at the same length (the planner says exactly 1/cp).

    .venv/bin/python benchmarks/context_parallel.py [--seq-lens 256,512,1024] [--cp 1,2,4]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from meshlm.model import Transformer, preset
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.plan.memory import Candidate, Workload, layer_activation_bytes, logits_bytes
from meshlm.testing import global_batch, run_distributed

MODEL = preset("test").replace(max_seq_len=1024, n_kv_heads=4)  # 4 KV heads: Ulysses runs at cp = 4 too
MiB = 2**20


def measure(seq_len: int, attention: str) -> int:
    """This rank's peak saved-activation bytes in one forward of one sequence (a cp rank: its chunks)."""
    cp = dist.get_world_size()
    layout = f"cp={cp}" if cp > 1 else ""
    mesh = build_mesh(parse_layout(layout, cp), "cpu")
    torch.manual_seed(0)
    model = parallelize(Transformer(MODEL), mesh, {"cp_attention": attention})
    x, y = global_batch(0, 1, seq_len, MODEL.vocab_size)
    with ActivationMeter(model) as meter:
        loss = model.loss_fn(model(model.seq_shard(x)), model.seq_shard(y))
    loss.backward()
    return meter.peak


def predicted(seq_len: int, cp: int) -> float:
    """The planner's activations + loss buffers per rank for the same run."""
    w = Workload(MODEL, seq_len, 1, 1.0, precision="fp32")
    s = Candidate(parse_layout(f"cp={cp}", cp), micro_batch=1)
    layer = layer_activation_bytes(MODEL, seq_len, 1, 1, False, "none", "fp32", True, "meshlm", cp)
    return MODEL.n_layers * layer + logits_bytes(w, s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="256,512,1024")
    parser.add_argument("--cp", default="1,2,4")
    args = parser.parse_args()
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    cps = [int(c) for c in args.cp.split(",")]
    print("| seq_len | cp | attention | measured MiB / rank | predicted MiB / rank | meas / pred | meas vs cp=1 |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        base = None
        for cp in cps:
            for attention in ("ring", "ulysses") if cp > 1 else ("ring",):
                got = max(run_distributed(measure, cp, seq_len, attention, timeout=600))
                want = predicted(seq_len, cp)
                base = got if cp == 1 else base
                vs = f"{got / base:.3f} (1/cp = {1 / cp:.3f})" if base else "-"
                name = attention if cp > 1 else "-"
                print(f"| {seq_len} | {cp} | {name} | {got / MiB:.2f} | {want / MiB:.2f} | {got / want:.3f} | {vs} |")


if __name__ == "__main__":
    main()
