"""The training step as it was (synchronous batch, loss and norm read every step) against the hot path
without host syncs (batch prefetched in a background thread, loss and norm left on the device and read
once every k steps), side by side on the same model, weights and batches, taking turns step by step.

"sync" is what `train.sync_every = 1` runs without prefetching: `sampler.next_batch` then `train_step`
(loss and norm `.item()` before the update). "deferred" is `train.sync_every = k`: `Prefetcher.next_batch`
then `device_train_step`, with one stacked read per k steps. On CPU the syncs are free, so the point here
is no regression (the thread and the deferred read cost nothing); on a GPU the deferred path lets the host
queue step k+1 while step k runs (benchmarks/gpu/run.py). Prints a markdown table and the ratio.

    .venv/bin/python benchmarks/hot_path.py                    # tiny preset, 40 steps each, ~1 minute
    .venv/bin/python benchmarks/hot_path.py --every 10 --steps 60
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from side_by_side import one_process, print_ratio_table, step_arguments, take_turns

from meshlm.data import GlobalBatchSampler
from meshlm.model import Transformer
from meshlm.parallel.engine import parallelize
from meshlm.train.optim import build_optimizer, device_train_step, train_step
from meshlm.train.prefetch import Prefetcher


def main() -> None:
    parser = step_arguments(__doc__, steps=40)
    parser.add_argument("--every", type=int, default=10, help="deferred path: read losses every N steps")
    args = parser.parse_args()
    cfg, train, mesh = one_process(args)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 2_000_000).astype(np.int32)

    models, optimizers = {}, {}
    for name in ("sync", "deferred"):
        torch.manual_seed(0)
        models[name] = parallelize(Transformer(cfg), mesh)
        optimizers[name] = build_optimizer(models[name], train)
    sync_source = GlobalBatchSampler(tokens, args.seq_len, args.batch, seed=0)
    prefetcher = Prefetcher(GlobalBatchSampler(tokens, args.seq_len, args.batch, seed=0), args.steps)
    pending: list[torch.Tensor] = []
    losses: dict[str, list[float]] = {"sync": [], "deferred": []}

    def sync_step() -> None:
        x, y = sync_source.next_batch()
        losses["sync"].append(train_step(models["sync"], optimizers["sync"], x, y, train.lr, train.grad_clip)[0])

    def deferred_step() -> None:
        x, y = prefetcher.next_batch(0, 1)
        loss, norm, _ = device_train_step(models["deferred"], optimizers["deferred"], x, y, train.lr, train.grad_clip)
        pending.append(torch.stack((loss, norm)))
        if len(pending) == args.every:
            losses["deferred"].extend(row[0] for row in torch.stack(pending).tolist())
            pending.clear()

    wall, cpu = take_turns({"sync": sync_step, "deferred": deferred_step}, args.steps)
    if pending:
        losses["deferred"].extend(row[0] for row in torch.stack(pending).tolist())
    prefetcher.close()

    print(f"model {args.model}, batch {args.batch}×{args.seq_len}, {args.steps} steps each, read every {args.every}\n")
    print_ratio_table(wall, cpu, losses, args.batch * args.seq_len)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
