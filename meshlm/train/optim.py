"""AdamW (or any torch optimizer) over whatever parameters (or ZeRO shards) this rank owns, with warm-up +
cosine decay of the learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshlm.config import TrainSection
from meshlm.parallel.engine import ParallelModel


def build_optimizer(model: ParallelModel, train: TrainSection, fused: bool = False) -> torch.optim.AdamW:
    """meshlm's default optimizer: fp32 AdamW on the rank's parameters (matrices decay, vectors do not).
    `foreach` (multi-tensor kernels) by default; `fused` (one kernel per step, what the trainer uses on CUDA)
    can also skip a step on the device (`skips_on_device`). `meshlm.fit(optimizer=...)` takes any other."""
    return torch.optim.AdamW(
        model.optimizer_param_groups(train.weight_decay),
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        **({"fused": True} if fused else {"foreach": True}),
    )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a device-side `found_inf` flag (the protocol torch.amp.GradScaler
    uses): the fused Adam, AdamW and SGD kernels then leave weights, moments and step counts untouched when
    it is 1, with no host sync."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


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
    commit: Callable[[], bool] | None = None,
) -> tuple[float, float, bool | None]:
    """One optimizer step on this replica's slice of the global batch; returns (loss, grad norm, applied).

    `allow_update(loss, grad_norm)` may veto the update (non-finite or spiking loss): gradients are then
    dropped and the weights stay as they were. Loss and norm are global, so every rank decides alike.
    `commit()` (fault-tolerant replica groups: meshlm.train.replicas) runs between the gradient sync and the
    update: False (a peer group failed mid-step) drops the gradients before the guard sees them, applied None.
    """
    loss_t = model.forward_backward(inputs, targets)
    grad_norm_t = model.clip_grad_norm_(grad_clip)
    if commit is not None and not commit():
        model.zero_grad()
        return loss_t.item(), grad_norm_t.item(), None
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
    allow_update: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`train_step` without a host sync: (loss, grad norm, applied) come back as device tensors, for the
    caller to read later, many steps at once. Without `allow_update` the update is always applied (applied
    None). With it (a device-side veto such as guards.DeviceStepGuard.allow, taking and returning device
    tensors), the optimizer (one that `skips_on_device`) skips the update on the device where it says no,
    exactly as `train_step` would have skipped it."""
    loss = model.forward_backward(inputs, targets).detach()
    grad_norm = model.clip_grad_norm_(grad_clip)
    if allow_update is None:
        _apply(model, optimizer, lr)
        return loss, grad_norm, None
    applied = allow_update(loss, grad_norm)
    optimizer.found_inf = (~applied).float()
    try:
        _apply(model, optimizer, lr)
    finally:
        del optimizer.found_inf
    return loss, grad_norm, applied


def _apply(model: ParallelModel, optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.step(optimizer)
