"""What a checkpoint holds for a ParallelModel: its fp32 weights and optimizer state as global tensors.

Keys are layout-free (`model/<name>`, `optim/<state>/<name>` for each per-element optimizer state, e.g.
AdamW's exp_avg and exp_avg_sq, each of the full model's shape), so any layout can load what any other
layout saved. This rank contributes the boxes it
holds: ZeRO flat pieces cut into row boxes (shards.flat_range_boxes), placed by the shards the model's
placement table records for the parameter (meshlm.parallel.placement), one per mesh dimension that cuts it,
each along its tensor dim (one box per run: a fused projection's slice is several), whichever strategy cut it
(tp's slices, ep's slice of stacked experts along dim 0; under ep × tp both).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from meshlm.checkpoint.shards import Chunks, flat_range_boxes
from meshlm.parallel.engine import ParallelModel


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
            shards = model.placements[params[piece.name]].shards
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
    one step at learning rate and weight decay 0 on zero gradients of the tensors without state (weights
    unchanged; moments and momentum buffers zero, as a first step would start them: for AdamW and SGD
    without dampening the same as no state), then their step counts back to 0. Tensors with state (stepped
    already) are left out of that step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = [p for p in params if not optimizer.state.get(p)]
    if not fresh:
        return
    saved = [{k: group[k] for k in ("lr", "weight_decay") if k in group} for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group.update({k: 0.0 for k in ("lr", "weight_decay") if k in group})
    for p in params:
        p.grad = None
    for p in fresh:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    _set_steps([optimizer.state[p] for p in fresh], 0)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer has applied (skipped steps do not count): the most any of its tensors has had
    (a parameter without a gradient in a step is not updated), for optimizers that count them (Adam,
    AdamW); 0 for those that do not (SGD)."""
    return max((int(state.get("step", 0)) for state in optimizer.state.values()), default=0)


def set_optimizer_steps(optimizer: torch.optim.Optimizer, steps: int) -> None:
    _set_steps(list(optimizer.state.values()), steps)


def _set_steps(states: list[dict], steps: int) -> None:
    for state in states:
        if torch.is_tensor(state.get("step")):
            state["step"].fill_(steps)
        elif "step" in state:
            state["step"] = steps


def step_counts(model: ParallelModel, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What a checkpoint records of the step counts: 'optimizer_steps' (optimizer_steps over the world) and
    'skipped_steps', for each parameter updated fewer times (no gradient in some steps: skipped as one
    process skips it) by how many, under its layout-free name. Collective: every rank calls it."""
    local: dict[str, int] = {}
    for name, tensor in model.named_optimizer_tensors():
        state = optimizer.state.get(tensor) or {}
        local[name] = max(local.get(name, 0), int(state.get("step", 0)))
    every = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, local)
    counts: dict[str, int] = {}
    for part in every:
        for name, steps in part.items():
            counts[name] = max(counts.get(name, 0), steps)
    steps = max(counts.values(), default=0)
    return {"optimizer_steps": steps, "skipped_steps": {n: steps - c for n, c in sorted(counts.items()) if c < steps}}


def load_step_counts(model: ParallelModel, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Set the step counts `step_counts` recorded (a checkpoint without 'skipped_steps': every tensor alike)."""
    steps, skipped = saved["optimizer_steps"], saved.get("skipped_steps", {})
    set_optimizer_steps(optimizer, steps)
    if skipped:
        behind = [(tensor, skipped[name]) for name, tensor in model.named_optimizer_tensors() if name in skipped]
        for tensor, k in behind:
            _set_steps([optimizer.state[tensor]], steps - k)
