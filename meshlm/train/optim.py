"""AdamW (or any torch optimizer) over whatever parameters (or ZeRO shards) this rank owns, with warm-up +
cosine decay of the learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshlm.config import TrainSection
from meshlm.parallel.engine import ParallelModel


def build_optimizer(model: ParallelModel, train: TrainSection) -> torch.optim.AdamW:
    """meshlm's default optimizer: fp32 AdamW on the rank's parameters (matrices decay, vectors do not);
    `foreach` keeps the step fast on CPU and GPU alike. `meshlm.fit(optimizer=...)` takes any other."""
    return torch.optim.AdamW(
        model.optimizer_param_groups(train.weight_decay),
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        foreach=True,
    )


def lr_at(step: int, train: TrainSection) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr_ratio·lr` at `steps`."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


def train_step(
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    lr: float,
    grad_clip: float,
    allow_update: Callable[[float, float], bool] | None = None,
) -> tuple[float, float, bool]:
    """One optimizer step on this replica's slice of the global batch; returns (loss, grad norm, applied).

    `allow_update(loss, grad_norm)` may veto the update (non-finite or spiking loss): gradients are then
    dropped and the weights stay as they were. Loss and norm are global, so every rank decides alike.
    """
    loss_t = model.forward_backward(inputs, targets)
    grad_norm_t = model.clip_grad_norm_(grad_clip)
    loss, grad_norm = loss_t.item(), grad_norm_t.item()
    applied = allow_update is None or allow_update(loss, grad_norm)
    if applied:
        _apply(model, optimizer, lr)
    else:
        model.zero_grad()
    return loss, grad_norm, applied


def device_train_step(
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    lr: float,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`train_step` without a host sync: the update is always applied and the (loss, grad norm) come back as
    device tensors, for the caller to read (and guard) later, many steps at once."""
    loss = model.forward_backward(inputs, targets).detach()
    grad_norm = model.clip_grad_norm_(grad_clip)
    _apply(model, optimizer, lr)
    return loss, grad_norm


def _apply(model: ParallelModel, optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.step(optimizer)
