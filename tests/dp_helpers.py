"""Shared by the data-parallel tests: DataParallel options set directly, and a built model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshlm.config import TrainSection
from meshlm.model import ModelConfig, Transformer
from meshlm.parallel.dp import data_parallel
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train.optim import build_optimizer


@contextlib.contextmanager
def dp_options(activation_checkpointing: bool = False, **options: object) -> Iterator[None]:
    """Make the engine build DataParallel with options set directly (shard_group_size, and param_dtype, which
    ParallelSection does not carry yet) and with activation checkpointing switched on in its chunks."""
    original = data_parallel.DataParallel

    def make(chunks: list, group: dist.ProcessGroup, **kwargs: object) -> data_parallel.DataParallel:
        for chunk in chunks:
            chunk.activation_checkpointing = activation_checkpointing
        return original(chunks, group, **{**kwargs, **options})

    data_parallel.DataParallel = make
    try:
        yield
    finally:
        data_parallel.DataParallel = original


def build(
    model_cfg: ModelConfig, zero: int, bucket_mb: float, n_micro: int = 1, **options: object
) -> tuple[ParallelModel, torch.optim.Optimizer, TrainSection]:
    """A pure data-parallel ParallelModel over the whole world, and its optimizer, as train_layout builds them."""
    mesh = build_mesh(parse_layout("", dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    with dp_options(**options):
        pm = parallelize(Transformer(model_cfg), mesh, {"zero": zero, "bucket_mb": bucket_mb, "micro_batches": n_micro})
    train = TrainSection(steps=10, global_batch=8, lr=3e-3, eps=1e-6, warmup_steps=2)
    return pm, build_optimizer(pm, train), train
