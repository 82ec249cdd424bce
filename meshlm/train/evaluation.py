"""Validation loss of a parallel model: meshlm's own data's fixed windows, or the user's global batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshlm.config import Config
from meshlm.data import SFTData, TokenData
from meshlm.parallel.engine import ParallelModel
from meshlm.train.parts import Batch


def evaluate(model: ParallelModel, data: TokenData | SFTData, cfg: Config, dp_rank: int, dp: int) -> float:
    """Mean loss over a fixed set of validation batches (the same windows every time)."""
    device = model_device(model)
    losses = [
        model.eval_loss(x.to(device), y.to(device)).item()
        for x, y in data.eval_batches(cfg.data.seq_len, cfg.train.global_batch, cfg.train.eval_batches, dp_rank, dp)
    ]
    return sum(losses) / len(losses)


def evaluate_batches(model: ParallelModel, batches: Iterable[Batch]) -> float:
    """Mean loss over user-given global validation batches (this replica's rows of each)."""
    device = model_device(model)
    losses = [
        model.eval_loss(model.local_batch(x).to(device), model.local_batch(y).to(device)).item() for x, y in batches
    ]
    if not losses:
        raise ValueError("eval_data yielded no batches")
    return sum(losses) / len(losses)


def model_device(model: ParallelModel) -> torch.device:
    return next(model.chunks[0].parameters()).device
