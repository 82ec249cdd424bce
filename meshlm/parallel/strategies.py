"""The strategies in composition order, the one layout check over them, and their application.

Each parallelism is a folder of its own (meshlm.parallel.tp, cp, ep, pp, dp; the transforms in
meshlm.parallel.transforms) holding its size rules and Strategy class (`strategy.py`, which imports no torch),
its plan rules, its run-time hooks and its mechanics; each keeps the contract of meshlm.parallel.contract.

STRATEGIES lists them in composition order: Adapt (a transform of the plain model, no mesh dimension) freezes
train.freeze's parameters and wraps the LoRA targets, before anything checks or records the model, so tensor
parallel shards each adapter with its base and data parallel packs only what trains; tensor parallel swaps the
modules its plan names for sharded ones; the fused loss (not a mesh dimension, but a transform of the head that must
see tp's) fuses the head with the cross-entropy; context parallel swaps the attention cores; expert parallel keeps
this rank's experts; pipeline parallel keeps this rank's stages (its Applied carries them: `chunks`); data parallel /
ZeRO lays out what is left (materialising a meta-built model's shard on the device) and owns gradient reduction (its
Applied carries `grads`, the one owner of the gradients and optimizer tensors, meshlm.parallel.dp.gradients); FP8
swaps the blocks' Linear layers and Compile compiles the blocks (transforms of what runs, no mesh dimension).
A new strategy is a folder and one entry here.

`check_layout(spec, model, plan)` below is the one entry point to the checks: sizes only (no model, no torch) for
the run config's validation (meshlm.train.startup.check_config) and the planner's search (meshlm.plan.search), so
they accept the same layouts (tests/unit/test_layout_agreement.py); with the model, once per build, by ParallelModel
(meshlm's model and a user's alike, whether from `meshlm train` or `meshlm.parallelize`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshlm.parallel.contract import Build, Composition, LayoutSpec, Strategy
from meshlm.parallel.cp.strategy import ContextParallel
from meshlm.parallel.dp.strategy import DataParallelism
from meshlm.parallel.ep.strategy import ExpertParallel
from meshlm.parallel.pp.strategy import PipelineParallel
from meshlm.parallel.tp.strategy import TensorParallel
from meshlm.parallel.transforms.strategy import FP8, Adapt, Compile, FusedLoss, ModelTransform

if TYPE_CHECKING:
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan

STRATEGIES: tuple[Strategy, ...] = (
    Adapt(),
    TensorParallel(),
    FusedLoss(),
    ContextParallel(),
    ExpertParallel(),
    PipelineParallel(),
    DataParallelism(),
    FP8(),
    Compile(),
)


def check_layout(spec: LayoutSpec, model: nn.Module | None = None, plan: ParallelPlan | None = None) -> int:
    """The one layout check: with `model`, every enabled strategy's check of it against `plan` (default: the
    plan registered for its class), before anything changes (one-line PlanErrors); then every strategy's size
    checks (one-line LayoutErrors). Returns the micro-batches per replica."""
    if model is not None:
        from meshlm.parallel.plan_registry import plan_for

        plan = plan or plan_for(model)
        for strategy in STRATEGIES:
            if strategy.enabled(spec.layout, spec.options):
                strategy.check(model, plan, spec.layout, spec.options)
        if spec.model is None and not spec.n_layers:
            n_layers = len(model.get_submodule(plan.pipeline.layers)) if plan.pipeline is not None else 1
            spec = dataclasses.replace(spec, n_layers=n_layers)
    for strategy in STRATEGIES:
        strategy.check_layout(spec)
    return spec.n_micro


def apply_strategies(build: Build, model_transforms: bool = False) -> Composition:
    """Every enabled strategy's transform, in composition order, and what they made. With `model_transforms`,
    only the transforms of the plain model (ModelTransform: Adapt), which the engine applies before its checks;
    without, all the others. Each strategy gets the build with `chunks` as the strategies before it left them
    (a strategy's Applied.chunks replaces them); the composition collects the hooks in order, the last chunks,
    and the gradients' owner, per-token loss and parts the strategies handed on."""
    done = Composition(applied=[], chunks=[build.model])
    for strategy in STRATEGIES:
        if isinstance(strategy, ModelTransform) != model_transforms:
            continue
        if not strategy.enabled(build.mesh.layout, build.options):
            continue
        applied = strategy.apply(dataclasses.replace(build, chunks=tuple(done.chunks)))
        done.applied.append(applied)
        done.chunks = applied.chunks if applied.chunks is not None else done.chunks
        done.grads = applied.grads if applied.grads is not None else done.grads
        done.token_loss = applied.token_loss if applied.token_loss is not None else done.token_loss
        done.parts.update(applied.parts)
    return done


__all__ = ["STRATEGIES", "apply_strategies", "check_layout"]
