"""The library API against meshlm's built-in step: same model, same batches, alternating step by step.

"built-in" is the trainer's `train_step` (ParallelModel.forward_backward, clip, optimizer, ZeRO gather);
"API" is the loop a user writes with `meshlm.parallelize` (model(x), loss, backward, clip_grad_norm_, step).
Both start from the same weights and take turns each step (alternating which goes first), so a slower
machine or a noisy neighbour hits both alike; the median step time counts, and the median CPU time per step
(this process's, single-threaded) is insensitive to time slicing on a shared machine. Prints a markdown table and the
API/built-in ratio.

    .venv/bin/python benchmarks/api_overhead.py                    # tiny preset, 40 steps each, ~1 minute
    .venv/bin/python benchmarks/api_overhead.py --zero 1 --steps 20
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from side_by_side import one_process, print_ratio_table, step_arguments, take_turns

import meshlm
from meshlm.model import Transformer
from meshlm.parallel.engine import parallelize
from meshlm.train.optim import build_optimizer, train_step


def main() -> None:
    parser = step_arguments(__doc__, steps=40)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    cfg, train, mesh = one_process(args)

    torch.manual_seed(0)
    builtin = parallelize(Transformer(cfg), mesh, {"zero": args.zero})
    builtin_opt = build_optimizer(builtin, train)
    torch.manual_seed(0)
    api = meshlm.parallelize(Transformer(cfg), mesh, {"zero": args.zero})
    api_opt = build_optimizer(api, train)

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g) for _ in range(args.steps)]
    losses: dict[str, list[float]] = {"built-in": [], "API": []}

    def builtin_step() -> None:
        tokens = batches[len(losses["built-in"])]
        x, y = tokens[:, :-1], tokens[:, 1:]
        losses["built-in"].append(train_step(builtin, builtin_opt, x, y, train.lr, train.grad_clip)[0])

    def api_step() -> None:
        tokens = batches[len(losses["API"])]
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = api.loss_fn(api(x), y)
        api.backward(loss)
        api.clip_grad_norm_(train.grad_clip)
        api.step(api_opt)
        losses["API"].append(api.replica_mean(loss).item())

    wall, cpu = take_turns({"built-in": builtin_step, "API": api_step}, args.steps)
    print(f"model {args.model}, zero {args.zero}, batch {args.batch}×{args.seq_len}, {args.steps} steps each\n")
    print_ratio_table(wall, cpu, losses, args.batch * args.seq_len)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
