"""`train.compile`: eager blocks against torch.compile'd blocks (inductor), the same model, weights and
batches, taking turns step by step after the compiled copy's warm-up (compile time reported apart).

Each path is meshlm's `train_step` on a ParallelModel; the compiled one has `compile_blocks` applied, as
`train.compile = true` does. Prints a markdown table, the compiled / eager step-time ratio and the largest
relative loss difference.

    .venv/bin/python benchmarks/compile.py                    # tiny preset, 20 steps each, ~2 minutes
    .venv/bin/python benchmarks/compile.py --backend aot_eager
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from side_by_side import one_process, step_arguments

from meshlm.model import Transformer
from meshlm.parallel.engine import parallelize
from meshlm.parallel.transforms.compile import compile_blocks
from meshlm.train.optim import build_optimizer, train_step


def main() -> None:
    parser = step_arguments(__doc__, steps=20)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    cfg, train, mesh = one_process(args)
    models, optimizers = {}, {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        models[name] = parallelize(Transformer(cfg), mesh)
        optimizers[name] = build_optimizer(models[name], train)
    compile_blocks(models["compiled"].chunks, models["compiled"].plan, args.backend)

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g) for _ in range(args.steps)]
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    compile_s = 0.0
    for step, tokens in enumerate(batches):
        for name in ("eager", "compiled") if step % 2 == 0 else ("compiled", "eager"):
            start = time.perf_counter()
            losses[name].append(
                train_step(models[name], optimizers[name], tokens[:, :-1], tokens[:, 1:], train.lr, train.grad_clip)[0]
            )
            elapsed = time.perf_counter() - start
            if step == 0 and name == "compiled":
                compile_s = elapsed  # the first call compiles (forward and backward)
            elif step > 0:
                times[name].append(elapsed)

    tokens_per_step = args.batch * args.seq_len
    print(f"model {args.model}, backend {args.backend}, batch {args.batch}×{args.seq_len}, {args.steps} steps each\n")
    print("| path | median step (ms) | tokens/s | first step (s) | final loss |")
    print("|---|---|---|---|---|")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name in times:
        first = f"{compile_s:.1f}" if name == "compiled" else "—"
        print(
            f"| {name} | {medians[name] * 1e3:.1f} | {tokens_per_step / medians[name]:.0f} | {first} "
            f"| {losses[name][-1]:.6f} |"
        )
    print(f"\ncompiled / eager step time: {medians['compiled'] / medians['eager']:.3f}")
    worst = max(abs(c / e - 1) for e, c in zip(losses["eager"], losses["compiled"], strict=True))
    print(f"largest relative loss difference: {worst:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
