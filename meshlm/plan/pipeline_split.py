"""The pipeline side of the planner's memory: how a runtime cuts the model into chunks and ranks, and how many
layer-activations a pipeline rank holds at its peak, replaying the runtime's own schedule
(`meshlm.parallel.pp.stages.stage_layers`, `meshlm.parallel.pp.schedules.compute_order`). docs/planner.md has the
formulas and sources."""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Literal

from meshlm.model.config import ModelConfig
from meshlm.parallel.pp.schedules import compute_order
from meshlm.parallel.pp.stages import stage_layers

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb1"]
# Whose kernels and pipeline split run the step: meshlm's eager PyTorch layer (unfused RMSNorm and SwiGLU,
# at least one layer per pipeline chunk), or a Megatron-style production stack with fused norm and SwiGLU
# kernels that also allows Llama 3's empty first and last chunks (the published runs of docs/planner.md).
Runtime = Literal["meshlm", "megatron"]


def max_chunks(model: ModelConfig, runtime: Runtime) -> int:
    """Most pipeline chunks (pp × virtual stages) a runtime can cut the model into."""
    return model.n_layers + (2 if runtime == "megatron" else 0)


@lru_cache(maxsize=4096)
def chunk_layers(model: ModelConfig, chunks: int, runtime: Runtime = "meshlm") -> tuple[int, ...]:
    """Layers of each model chunk, as the runtime splits them: meshlm's `stage_layers` (contiguous, at least
    one layer each, balancing FLOPs with the embedding on the first chunk and the head on the last). Beyond
    one chunk per layer the Megatron-style runtime leaves the first and last chunks empty (embedding and
    head alone), Llama 3's 405B recipe (Dubey et al. 2024, §3.3.2), and splits the rest the same way."""
    if chunks > model.n_layers and runtime == "megatron":
        return (0, *(len(r) for r in stage_layers(model, chunks - 2)), 0)
    return tuple(len(r) for r in stage_layers(model, chunks))


@lru_cache(maxsize=4096)
def rank_chunks(model: ModelConfig, pp: int, virtual_stages: int = 1, runtime: Runtime = "meshlm") -> tuple:
    """Per pipeline rank, the layers of each chunk it holds: rank i holds chunks i, i+pp, i+2pp, ..."""
    chunks = chunk_layers(model, pp * virtual_stages, runtime)
    return tuple(chunks[i::pp] for i in range(pp))


def rank_layers(model: ModelConfig, pp: int, virtual_stages: int = 1, runtime: Runtime = "meshlm") -> tuple[int, ...]:
    """Layers each pipeline rank holds."""
    return tuple(sum(c) for c in rank_chunks(model, pp, virtual_stages, runtime))


@lru_cache(maxsize=4096)
def representative_stages(chunks: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Stages worth evaluating: first, second, last, and the first of each run of equal chunk splits. Every
    schedule keeps the most micro-batches in flight on the earliest stages, so these hold the maxima."""
    return tuple(i for i in range(len(chunks)) if i in (0, 1, len(chunks) - 1) or chunks[i] != chunks[i - 1])


def chunk_full_layers(chunks: tuple[int, ...], recompute_layers: int) -> tuple[int, ...]:
    """Of each chunk's layers, how many are fully recomputed under `recompute_layers` (the first N of each)."""
    return tuple(min(n, recompute_layers) for n in chunks)


@lru_cache(maxsize=4096)
def _held_steps(schedule: ScheduleName, pp: int, micro_batches: int, virtual_stages: int) -> tuple:
    """Per pipeline rank, the runtime's order of what stores or frees activations, as indices into a rank's
    chunks followed by their negatives (`held_layers`): chunk c for its forward, n_chunks + c for its free (its
    B, or its W under zero-bubble). Actions that neither store nor free change nothing held, and are left out."""
    frees = "W" if schedule == "zb1" else "B"
    orders = compute_order(schedule, pp, micro_batches, virtual_stages)
    return tuple(
        tuple(a.chunk if a.kind == "F" else virtual_stages + a.chunk for a in order if a.kind in ("F", frees))
        for order in orders
    )


@lru_cache(maxsize=8192)
def held_layers(
    schedule: ScheduleName, pp: int, micro_batches: int, virtual_stages: int, stage: int, chunks: tuple
) -> float:
    """Peak layer-activations (one micro-batch through one layer = 1) that pipeline rank `stage` holds, with
    `chunks` the layers of each of its chunks (or each chunk's bytes per micro-batch: then bytes),
    replaying the runtime's own order of forwards and backwards
    (1F1B keeps pp − stage, interleaved Megatron's 2(pp − stage − 1) + (v − 1)·pp + 1 chunks, ZB-H1 pp on
    every stage until each W). GPipe keeps
    all m. A 1F1B or interleaved order does not depend on m up to its drain, and after the warm-up (under
    2·pp micro-batches) what is held repeats every pp micro-batches, so replaying 4·pp of them finds the peak:
    the largest running sum of the chunks stored (+) and freed (−) in that order, from 0."""
    if pp == 1:
        return sum(chunks)  # gradient accumulation: one micro-batch at a time
    if schedule == "gpipe":
        return micro_batches * sum(chunks)
    signed = (*chunks, *(-c for c in chunks))
    steps = _held_steps(schedule, pp, min(micro_batches, 4 * pp), virtual_stages)[stage]
    return max(itertools.accumulate(map(signed.__getitem__, steps), initial=0))


@lru_cache(maxsize=32768)
def recomputed_activations(
    schedule: ScheduleName,
    pp: int,
    micro_batches: int,
    virtual_stages: int,
    stage: int,
    chunks: tuple[int, ...],
    recompute_layers: int,
    full_layer: float,
    mean_layer: float,
) -> float:
    """Peak activation bytes of pipeline rank `stage` (`held_layers`) when the first `recompute_layers` layers of
    each of its chunks (`chunks`: their layers) are fully recomputed, at `full_layer` bytes each, and the rest
    keep `mean_layer` bytes."""
    full = chunk_full_layers(chunks, recompute_layers)
    weighted = tuple(f * full_layer + (n - f) * mean_layer for n, f in zip(chunks, full, strict=True))
    # uncached: a tuple of floats equals a tuple of ints of the same values, whose cached result is an int
    return held_layers.__wrapped__(schedule, pp, micro_batches, virtual_stages, stage, weighted)
