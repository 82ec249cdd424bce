"""The one-process reference of a run of fault-tolerant replica groups
(tests/integration/test_replica_groups_recovery.py):
`python tests/replica_replay.py OUT.pt STEPS GROUPS DP --section.field VALUE ...` replays the schedule of live groups
the run logged (the "replicas" records of every group's metrics.jsonl) in ONE process: at step k with n live groups
it reads the same n chunks of global_batch / GROUPS rows at the same sample position, each split over the group's
DP ranks, backpropagates each rank's rows on their own (with the loss scaled by the n chunks' kept tokens), sums a
group's ranks in rank order, then the groups in quorum order (the order of the groups' fixed-order sum), clips,
and takes meshlm's AdamW step at lr_at(k). Saves the final full weights to OUT.pt.

"The survivors' trajectory equals one process fed the same (smaller) batches", bit for bit: each chunk's
gradient is what its group's backward computes (the same rows, shapes and kernels), and the sum is the same
additions in the same order (issue #52, item 5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from meshlm.config import load_config, parse_overrides
from meshlm.parallel.distributed import init_distributed
from meshlm.train.guards import Watchdog
from meshlm.train.optim import lr_at
from meshlm.train.startup import check_config
from meshlm.train.trainer import Trainer


def schedule(run_dir: Path, groups: int) -> dict[int, int]:
    """Step -> live groups, from every group's "replicas" records: the latest record (by time) at or before a step
    wins (a step a group failed is redone, and logged again, with the new quorum)."""
    records = []
    for g in range(groups):
        for line in (run_dir / f"group-{g}" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "replicas":
                records.append((record["time"], record["step"], record["live_groups"]))
    records.sort()
    live: dict[int, int] = {}
    for _, step, n in records:  # a later record overrides from its step on
        for k in [k for k in live if k >= step]:
            del live[k]
        live[step] = n
    return live


def live_at(changes: dict[int, int], step: int) -> int:
    return changes[max(k for k in changes if k <= step)]


def main() -> None:
    out, steps, groups, dp, *args = sys.argv[1:]
    steps, groups, dp = int(steps), int(groups), int(dp)
    cfg = load_config(None, parse_overrides(args))
    run_dir = Path(cfg.log.run_dir)
    changes = schedule(run_dir, groups)
    cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"run_dir": str(run_dir / "replay")}),
                                 "fault": cfg.fault.model_copy(update={"replica_groups": 1})})  # fmt: skip
    layout, n_micro = check_config(cfg, 1)
    device = torch.device("cpu")
    init_distributed(device, 60)
    trainer = Trainer(cfg, layout, n_micro, device, Watchdog(run_dir / "replay", 0, 0))
    model, optimizer, source = trainer.model, trainer.optimizer, trainer.sampler.source
    rows, samples = cfg.train.global_batch // groups, 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for k in range(steps):
        n = live_at(changes, k + 1)
        # group r's rank j: rows [samples + r·rows + j·rows/dp, ...), dp = the group's data-parallel ranks
        chunks = [
            [source.rows_at(samples + r * rows + j * rows // dp, rows // dp) for j in range(dp)] for r in range(n)
        ]
        count = sum((y != cfg.train.ignore_index).sum() for group in chunks for _, y in group).to(torch.float32)
        sums = []  # each group's gradient: its ranks' in rank order (gloo's all-reduce of 2 is a + b), then
        for group in chunks:  # the groups' in quorum order, as Across.sum_ adds them
            for x, y in group:
                with model.no_sync():
                    model.backward(model.loss_fn(model(x), y, num_tokens=count))
            sums.append([p.grad.clone() for p in params])
            model.zero_grad()
        for p, *terms in zip(params, *sums, strict=True):
            p.grad = terms[0].clone()
            for term in terms[1:]:
                p.grad += term
        model.clip_grad_norm_(cfg.train.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, cfg.train)
        model.step(optimizer)
        samples += n * rows
    torch.save({**model.full_state_dict(), "__live__": torch.tensor([live_at(changes, k + 1) for k in range(steps)])},
               out)  # fmt: skip


if __name__ == "__main__":
    main()
