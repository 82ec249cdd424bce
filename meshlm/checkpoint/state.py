"""What a checkpoint holds for a ParallelModel: its fp32 weights and optimizer state as global tensors.

Keys are layout-free (`model/<name>`, `optim/<state>/<name>` for each per-element optimizer state, e.g.
AdamW's exp_avg and exp_avg_sq, each of the full model's shape), so any layout can load what any other
layout saved. This rank contributes the boxes it
holds: ZeRO flat pieces cut into row boxes (shards.flat_range_boxes), placed by its TPShard (one box per run)
and, for an expert-parallel rank's slice of stacked experts, by its EP placement (dim 0; under ep × tp both).
"""

from __future__ import annotations

import math

import torch

from meshlm.checkpoint.shards import Chunks, flat_range_boxes
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.expert_parallel import placements


def key_of(kind: str, name: str) -> str:
    return f"model/{name}" if kind == "model" else f"optim/{kind}/{name}"


def training_entries(
    model: ParallelModel, optimizer: torch.optim.Optimizer | None = None, writer: bool = False, frozen: bool = False
) -> dict[str, Chunks]:
    """This rank's boxes of every global tensor, as views of the live weights (and optimizer moments): all it
    holds (to load into), or with `writer` its share of them (to save: every box is written by one rank).
    Frozen weights (a LoRA base) are not training state; `frozen` adds them, to load a base into."""
    shapes = model.global_shapes
    params = dict(model.named_parameters())
    entries: dict[str, Chunks] = {}
    for kind, pieces in model.local_shards(optimizer, writer, frozen).items():
        for piece in pieces:
            shards = placements(params[piece.name])
            entry = entries.setdefault(key_of(kind, piece.name), Chunks(shapes[piece.name], [], []))
            start = 0
            for offsets, sizes in flat_range_boxes(
                piece.global_shape, piece.offset, piece.offset + piece.local.numel()
            ):
                n = math.prod(sizes)
                view = piece.local[start : start + n].view(sizes)
                start += n
                boxes = [(view, offsets)]  # local offsets, made full along each sharded dim in turn
                for shard in shards:
                    # Along the sharded dim a box may cross runs (a fused projection's blocks): one box per run.
                    d = shard.dim
                    boxes = [
                        (v.narrow(d, local - o[d], length), tuple(full if i == d else x for i, x in enumerate(o)))
                        for v, o in boxes
                        for local, full, length in shard.runs(o[d], v.shape[d])
                    ]
                for v, o in boxes:
                    entry.views.append(v)
                    entry.offsets.append(o)
    return entries


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create any torch optimizer's state ahead of its first step, so a checkpoint can fill it in place:
    one step at learning rate and weight decay 0 on zero gradients (weights unchanged; moments and momentum
    buffers zero, as a first step would start them), then the step counts back to 0."""
    if all(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        return
    saved = [{k: group[k] for k in ("lr", "weight_decay") if k in group} for group in optimizer.param_groups]
    zeroed = []
    for group in optimizer.param_groups:
        group.update({k: 0.0 for k in ("lr", "weight_decay") if k in group})
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                zeroed.append(p)
    optimizer.step()
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)
    for p in zeroed:
        p.grad = None
    set_optimizer_steps(optimizer, 0)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer has applied (the same for every parameter; skipped steps do not count), for
    optimizers that count them (Adam, AdamW); 0 for those that do not (SGD)."""
    for state in optimizer.state.values():
        return int(state.get("step", 0))
    return 0


def set_optimizer_steps(optimizer: torch.optim.Optimizer, steps: int) -> None:
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].fill_(steps)
        elif "step" in state:
            state["step"] = steps
