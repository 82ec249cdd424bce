"""The contract every parallelism keeps, below the strategies' folders and naming none of them.

A strategy (meshlm.parallel.{tp,cp,ep,pp,dp}/strategy.py, the transforms in meshlm.parallel.transforms) owns one
mesh dimension ("" for a transform) and three steps:

  check_layout(spec)                   sizes only — the model's shape, the batch, the sequence (a LayoutSpec);
                                       no model, no torch: one-line LayoutErrors.
  check(model, plan, layout, options)  the model in hand against its plan, before anything changes: a one-line
                                       PlanError naming the module.
  apply(build) -> Applied              transforms this rank's modules in place (`build.model`, `build.chunks`),
                                       records every parameter it cuts or ties in `build.placements`
                                       (meshlm.parallel.placement: nothing is stored on a tensor), and returns
                                       an `Applied`: its run-time hooks, and what it made that later strategies
                                       and the engine need (its products).

`Build` is what a strategy reads: the model, the mesh, the options and plan, the loss set-up, the placement table
it records into, the step context (a pipeline's callbacks into the step: the scaled loss, autocast, the grad-sync
switch) and `chunks`, this rank's modules as the strategies before it left them. It is frozen: no strategy
writes to it. A strategy hands its products on through its `Applied` — `chunks` (the pipeline's stages),
`grads` (the one owner of the gradients and optimizer tensors: data parallel's), `token_loss` (the per-token
loss: tensor parallel's vocabulary-parallel one) and `parts` (named objects for inspection) — and
meshlm.parallel.strategies.apply_strategies passes them on: each strategy gets a Build whose `chunks` are the
latest, and the engine gets a `Composition` of them all.

The hooks (`Applied`) receive what they act on — a batch, the gradients' owner, this rank's parameters by name —
and hold the mesh and placement table their strategy gave them; none receives the engine.

Imports no torch at run time: the size checks run in `meshlm plan` and the run config's validation without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from meshlm.model.config import ModelConfig
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import Loss, ParallelOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

    from meshlm.parallel.materialize import MetaInit
    from meshlm.parallel.mesh import Mesh
    from meshlm.parallel.parallel_plan import ParallelPlan
    from meshlm.parallel.placement import Placements

LossFn = Callable[[object, "torch.Tensor"], "torch.Tensor"]


def check_batch_split(layout: Layout, global_batch: int, micro_batch: int = 0) -> int:
    """The batch splits over the data replicas (dp × ep) and each replica's rows into micro-batches of
    `micro_batch` (0: one); return the micro-batches per replica."""
    dp = layout.data_parallel
    name = "dp×ep" if layout.ep > 1 else "dp"
    if global_batch % dp:
        raise LayoutError(f"train.global_batch ({global_batch}) is not divisible by {name}={dp}")
    local = global_batch // dp
    micro = micro_batch or local
    if local % micro:
        raise LayoutError(
            f"train.micro_batch ({micro}) must divide the per-replica batch global_batch/{name} = {local}"
        )
    return local // micro


@dataclass(frozen=True)
class LayoutSpec:
    """What a layout is checked against: the sizes, and the parallel options as they are declared
    (meshlm.parallel.options). `model` is meshlm's model shape, or None for a model whose shape only its plan
    knows (its `check`s cover the shape). `n_layers` bounds the pipeline chunks (the model's layers; the planner
    passes the chunks its modelled runtime cuts)."""

    model: ModelConfig | None
    layout: Layout
    global_batch: int
    micro_batch: int = 0
    seq_len: int = 0
    options: ParallelOptions = ParallelOptions()
    n_layers: int = 0

    @property
    def n_micro(self) -> int:
        """Micro-batches per replica; a one-line LayoutError if the batch does not split over dp × ep."""
        return check_batch_split(self.layout, self.global_batch, self.micro_batch)


@dataclass(frozen=True)
class StepContext:
    """What a strategy that runs the step's micro-batches itself (the pipeline) calls back into: a
    micro-batch's term of the step's loss, the autocast context, and whether the next backward of a chunk
    reduces gradients."""

    loss: LossFn
    autocast: Callable[[], contextlib.AbstractContextManager]
    set_grad_sync: Callable[[int, bool], None]


class ModelAdaptation(Protocol):
    """What the first transform applies to the plain model (train.freeze and LoRA adapters)."""

    def apply(self, model: nn.Module, plan: object | None = None) -> None: ...


def _placements() -> Placements:
    """An empty placement table (imported here: the layout checks above run without torch, e.g. `meshlm plan`)."""
    from meshlm.parallel.placement import Placements

    return Placements()


@dataclass(frozen=True)
class Build:
    """One ParallelModel being assembled: what each strategy reads (frozen: a strategy hands on what it makes
    through its Applied, see the module docstring)."""

    model: nn.Module
    mesh: Mesh
    options: ParallelOptions  # the strategies' and transforms' options, the micro-batches and the autocast dtype
    plan: ParallelPlan
    step: StepContext  # the pipeline schedule's callbacks into the step
    meta_init: MetaInit | None  # given by the engine after the model transforms (Adapt), before the rest
    device_type: str
    loss: Loss = field(default_factory=Loss)  # the user's function if any, ignore_index, gather_logits, fused
    adaptation: ModelAdaptation | None = None  # train.freeze and LoRA; None: neither
    placements: Placements = field(default_factory=_placements)  # where each parameter lives (readers' table)
    chunks: tuple[nn.Module, ...] = ()  # this rank's modules as the strategies applied before this one left them


class Gradients(Protocol):
    """The one owner of the gradients and optimizer tensors (a strategy's product, `Applied.grads`): what the
    hooks call on it."""

    grad_sync: list[bool]

    def grad_shards_of(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]: ...

    def set_grad_sync(self, chunk: int, enabled: bool) -> None: ...

    def check_not_synced(self) -> None: ...

    def finish_grad_sync(self) -> None: ...


class Applied:
    """An applied strategy: its run-time hooks, which ParallelModel runs for every applied strategy in order
    (each default leaves the step as it is), and its products (each None or empty: none made).

      local_rows(batch)            this replica's rows of a global batch (data parallel)
      check_batch(inputs)          refuse a batch the layout cannot have been meant to get (data parallel)
      shard_sequence(batch)        this rank's part of every sequence (context parallel)
      run_micro_batches(...)       run the step's micro-batches itself, returning this rank's loss (pipeline);
                                   None leaves them to the engine's plain loop
      check_direct_call()          refuse calling the model directly (pipeline)
      set_grad_sync(chunk, on)     whether the next backward of a chunk reduces gradients (data parallel)
      start_backward()             before any backward (data parallel: not on top of reduced gradients)
      end_backward(step, grads)    after the backward; run in reverse order, so that data parallel has reduced
                                   the gradients (held by `grads`) before the pipeline sums its tied weights'
                                   over both ends
      share_loss(loss)             make this rank's loss the one its replica reports (pipeline: the last stage's)
      gather_state(state, params)  this rank's full-precision state dict -> gathered over its dimension; `params`
                                   every name under which this rank holds a parameter (tied aliases included)
    """

    chunks: list[nn.Module] | None = None  # this rank's modules, when the strategy replaced them (its stages)
    grads: Gradients | None = None  # the gradients' owner, when the strategy took them on
    token_loss: LossFn | None = None  # the per-token loss, when the strategy replaced the model's
    parts: Mapping[str, object] = MappingProxyType({})  # named objects it made, for inspection (ParallelModel's)

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def check_batch(self, inputs: torch.Tensor) -> None:
        pass

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def run_micro_batches(
        self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor], train: bool
    ) -> torch.Tensor | None:
        return None

    def check_direct_call(self) -> None:
        pass

    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        pass

    def start_backward(self) -> None:
        pass

    def end_backward(self, step: bool, grads: Gradients) -> None:
        """`step`: the step's backward is over (forward_backward); else one backward of a loop of one's own."""

    def share_loss(self, loss: torch.Tensor) -> None:
        pass

    def gather_state(
        self, state: dict[str, torch.Tensor], params: Mapping[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        return state


@dataclass
class Composition:
    """The applied strategies in composition order and their products, passed on (apply_strategies)."""

    applied: list[Applied]
    chunks: list[nn.Module]
    grads: Gradients | None = None
    token_loss: LossFn | None = None
    parts: dict[str, object] = field(default_factory=dict)


class Strategy(Protocol):
    dim: str  # the mesh dimension it owns ("" for a transform that is not one)

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool: ...

    def check_layout(self, spec: LayoutSpec) -> None: ...

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None: ...

    def apply(self, build: Build) -> Applied: ...
