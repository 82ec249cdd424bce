"""The parallel layer's contract: each parallelism is a Strategy, and ParallelModel composes them in a loop.

A strategy owns one mesh dimension and three steps, each a call into its own module:

  check_layout(spec)                   sizes only — the model's shape, the batch, the sequence; no model, no
                                       torch: one-line LayoutErrors.
  check(model, plan, layout, options)  the model in hand against its plan, before anything changes: a one-line
                                       PlanError naming the module.
  apply(build) -> Applied              transforms this rank's model in place (`build.model`, `build.chunks`),
                                       records every parameter it cuts or ties in `build.placements`
                                       (meshlm.parallel.placement: its slice along which dim, which runs of the
                                       full tensor; nothing is stored on a tensor), and returns its run-time
                                       hooks (meshlm.parallel.runtime: the batch split, the micro-batches, the
                                       gradient synchronisation, gathering the state), which ParallelModel
                                       runs for every applied strategy in order. Which rank counts a
                                       gradient-norm term or writes a replicated tensor is recorded by `apply`
                                       in the placement table.

Each strategy's size rules are written here, next to its class (check_tensor_parallel before TensorParallel, and
so on), not in its module: tensor_parallel.py and the others build torch modules, and the rules must run without
torch (the run config's checks, the planner, `meshlm plan` start in about a second). The model rules (`check`)
live in each strategy's module, which `check` imports when it runs.

`check_layout(spec, model, plan)` below is the one entry point to both: sizes only (no model, no torch) for the
run config's validation (meshlm.train.trainer.check_config) and the planner's search (meshlm.plan.search), so
they accept the same layouts (tests/test_layout_agreement.py); with the model, once per build, by ParallelModel
(meshlm's model and a user's alike, whether from `meshlm train` or `meshlm.parallelize`).

STRATEGIES lists them in composition order: Adapt (a transform of the plain model, no mesh dimension) freezes
train.freeze's parameters and wraps the LoRA targets, before anything checks or records the model, so tensor
parallel shards each adapter with its base and data parallel packs only what trains; tensor parallel swaps the
modules its plan names for sharded ones; the fused loss (not a mesh dimension, but a transform of the head that must
see tp's) fuses the head with the cross-entropy; context parallel swaps the attention cores; expert parallel keeps
this rank's experts; pipeline parallel keeps this rank's stages; data parallel / ZeRO lays out what is left
(materialising a meta-built model's shard on the device) and owns gradient reduction: it sets `build.grads`, the one
owner of the gradients and optimizer tensors (meshlm.parallel.gradients); FP8 swaps the blocks' Linear layers and
Compile compiles the blocks (transforms of what runs, no mesh dimension).
A new strategy is one class here and one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from meshlm.model.config import ModelConfig
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import Loss, ParallelOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

    from meshlm.parallel.data_parallel import DataParallel
    from meshlm.parallel.engine import ParallelModel
    from meshlm.parallel.gradients import LocalGradients
    from meshlm.parallel.lora import Adaptation
    from meshlm.parallel.materialize import MetaInit
    from meshlm.parallel.mesh import Mesh
    from meshlm.parallel.pipeline import PipelineSchedule, TiedStages
    from meshlm.parallel.placement import Placements
    from meshlm.parallel.plan import ParallelPlan
    from meshlm.parallel.runtime import Applied

LossFn = Callable[[object, "torch.Tensor"], "torch.Tensor"]


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


def _adaptation() -> Adaptation:
    """No freezing, no LoRA (imported here: meshlm.parallel.lora needs torch)."""
    from meshlm.parallel.lora import Adaptation

    return Adaptation()


def _placements() -> Placements:
    """An empty placement table (imported here: the layout checks above run without torch, e.g. `meshlm plan`)."""
    from meshlm.parallel.placement import Placements

    return Placements()


@dataclass
class Build:
    """One ParallelModel being assembled: what the strategies read, and what they leave for the engine."""

    model: nn.Module
    mesh: Mesh
    options: ParallelOptions  # the strategies' and transforms' options, the micro-batches and the autocast dtype
    plan: ParallelPlan
    engine: ParallelModel  # the pipeline schedule's callbacks: the scaled loss, autocast, the grad-sync switch
    meta_init: MetaInit | None  # set by the engine after the model transforms (Adapt), before the rest
    device_type: str
    token_loss: LossFn  # per-token losses; tensor parallel makes it vocabulary-parallel
    loss: Loss = field(default_factory=Loss)  # the user's function if any, ignore_index, gather_logits, fused
    adaptation: Adaptation = field(default_factory=_adaptation)  # train.freeze and LoRA (meshlm.parallel.lora)
    placements: Placements = field(default_factory=_placements)  # where each parameter lives (readers' table)
    chunks: list[nn.Module] = field(default_factory=list)
    pipeline: PipelineSchedule | None = None
    dp: DataParallel | None = None  # data parallel / ZeRO's, where replicas reduce or ZeRO shards
    grads: DataParallel | LocalGradients | None = None  # the gradients' owner: `dp`, else the local parameters'
    tied: TiedStages | None = None


class Strategy(Protocol):
    dim: str  # the mesh dimension it owns ("" for a transform that is not one)

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool: ...

    def check_layout(self, spec: LayoutSpec) -> None: ...

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None: ...

    def apply(self, build: Build) -> Applied: ...


def check_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Raise a one-line LayoutError if the model (or, under SP, the sequence) does not split over tp.
    Needs no process group: call it while validating the config."""
    if tp == 1:
        return
    moe = ("moe_intermediate_size", "shared_expert_intermediate_size") if cfg.n_experts else ()
    for name in ("n_heads", "intermediate_size", "vocab_size", *moe):
        if getattr(cfg, name) % tp:
            raise LayoutError(f"model.{name} ({getattr(cfg, name)}) is not divisible by tp={tp}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise LayoutError(
            f"model.n_kv_heads ({cfg.n_kv_heads}) must divide or be divisible by tp={tp} (KV heads split or replicated)"
        )
    if sequence_parallel and seq_len % tp:
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by tp={tp}, needed by parallel.sequence_parallel")


class TensorParallel:
    """meshlm.parallel.tensor_parallel: the plan's Linear/Embedding modules sharded over `tp` (a TPShard each)."""

    dim = "tp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.tp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        if spec.model is not None:
            check_tensor_parallel(spec.model, spec.layout.tp, spec.seq_len, spec.options.sequence_parallel)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.plan import check_tp_plan
        from meshlm.parallel.probe import probe_tensor_parallel

        check_tp_plan(model, plan, layout.tp, options.sequence_parallel)
        probe_tensor_parallel(model, plan, layout.tp)  # each distinct block split vs whole (docs/api.md)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.runtime import TensorParallelHooks
        from meshlm.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

        tp = apply_tensor_parallel(
            build.model, build.mesh.group("tp"), build.placements, build.options.sequence_parallel, build.plan
        )
        for m in build.model.modules():
            if getattr(m, "vocab_head", False):
                m.gather_output = build.loss.gather_logits
        if build.loss.fn is None and not build.loss.gather_logits:
            ignore_index = build.loss.ignore_index

            def tp_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
                logits = getattr(output, "logits", output)
                return vocab_parallel_cross_entropy(logits, targets, tp.group, ignore_index)

            build.token_loss = tp_loss
        return TensorParallelHooks()


class Transform:
    """A strategy with no mesh dimension, no size or model rules and no run-time hook: it changes the modules
    that run when its build asks for it (`transform`). Adapt, FusedLoss, FP8 and Compile."""

    dim = ""

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        pass

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        pass

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.runtime import Applied

        self.transform(build)
        return Applied()

    def transform(self, build: Build) -> None:
        """Change `build`'s modules in place, if its build asks for this transform (each subclass's own)."""
        raise NotImplementedError(type(self).__name__)


class ModelTransform(Transform):
    """A transform of the plain model, the one the layout is of (its parameters, their names and full shapes):
    the engine applies it first, before it checks the model against the layout, records its names and shapes,
    and materialises a meta-built model."""


class Adapt(ModelTransform):
    """meshlm.parallel.lora: train.freeze's parameters frozen and LoRA adapters wrapped around the targets
    (`build.adaptation`), first, so tensor parallel shards each adapter with its base and data parallel packs,
    reduces and shards only what trains. Under bf16 autocast the frozen Linear weights are kept in bf16
    (autocast casts them at each use anyway: the same numbers, half the bytes)."""

    def transform(self, build: Build) -> None:
        import torch

        from meshlm.parallel.lora import cast_frozen_linears

        build.adaptation.apply(build.model, build.plan)
        if build.options.autocast_dtype == "bf16":
            cast_frozen_linears(build.model, torch.bfloat16)


class FusedLoss(Transform):
    """meshlm.parallel.fused_loss: the vocabulary head and meshlm's cross-entropy computed together, chunk by
    chunk (vocabulary-parallel after tensor parallel). Only for meshlm's own loss on logits it never returns.
    Under ZeRO-3 the head's unit stays gathered until the fused loss has run (docs/zero.md)."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.fused_loss import apply_fused_loss

        if build.loss.fused and build.loss.fn is None and not build.loss.gather_logits:
            apply_fused_loss(build.model, build.plan)


def check_context_parallel(
    cfg: ModelConfig, cp: int, tp: int, seq_len: int, attention: str, sequence_parallel: bool = False
) -> None:
    """Raise a one-line LayoutError if the sequence (ring) or the heads (Ulysses) do not split over cp.
    The ring's causal load balancing cuts each sequence into 2·cp chunks; Ulysses trades the sequence
    shard for cp-th of each rank's (tp-local) heads, query and key/value alike."""
    if cp == 1:
        return
    if attention not in ("ring", "ulysses"):
        raise LayoutError(f"parallel.cp_attention = {attention!r}; valid: 'ring', 'ulysses'")
    if cfg.sliding_window:
        raise LayoutError(f"context parallel (cp={cp}) needs full causal attention, not model.sliding_window")
    if seq_len and seq_len % (2 * cp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by 2·cp = {2 * cp} (load-balanced chunks)")
    if sequence_parallel and seq_len and seq_len % (cp * tp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by cp×tp = {cp * tp} under sequence_parallel")
    if attention == "ulysses":
        for name in ("n_heads", "n_kv_heads"):
            if getattr(cfg, name) % (cp * tp):
                raise LayoutError(
                    f"model.{name} ({getattr(cfg, name)}) is not divisible by cp×tp = {cp * tp}, "
                    f"needed by parallel.cp_attention = 'ulysses' (use 'ring')"
                )


class ContextParallel:
    """meshlm.parallel.context_parallel: each rank holds part of every sequence; ring or Ulysses attention."""

    dim = "cp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.cp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        lay, options = spec.layout, spec.options
        if spec.model is not None:
            check_context_parallel(
                spec.model, lay.cp, lay.tp, spec.seq_len, options.cp_attention, options.sequence_parallel
            )

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.context_parallel import check_cp_plan

        check_cp_plan(model, plan)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.context_parallel import apply_context_parallel
        from meshlm.parallel.runtime import ContextParallelHooks

        apply_context_parallel(build.model, build.plan, build.mesh.group("cp"), build.options.cp_attention)
        return ContextParallelHooks(build.mesh)


def check_expert_parallel(cfg: ModelConfig, layout: Layout) -> None:
    """Raise a one-line LayoutError if the model has no experts to split over ep or they do not split evenly
    (meshlm.parallel.expert_parallel; ep composes with dp, pp, cp and tp: check_tensor_parallel splits the
    experts' hidden units). Needs no process group."""
    ep = layout.ep
    if ep == 1:
        return
    if not cfg.n_experts:
        raise LayoutError(f"parallel.layout ep={ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if cfg.n_experts % ep:
        raise LayoutError(f"model.n_experts ({cfg.n_experts}) is not divisible by ep={ep}")


class ExpertParallel:
    """meshlm.parallel.expert_parallel: each rank keeps E/ep of every MoE layer's experts, reached by all-to-all."""

    dim = "ep"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.ep > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        if spec.model is not None:
            check_expert_parallel(spec.model, spec.layout)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.expert_parallel import check_ep_model

        check_ep_model(model, layout, options)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.expert_parallel import apply_expert_parallel
        from meshlm.parallel.runtime import ExpertParallelHooks

        apply_expert_parallel(build.model, build.mesh.group("ep"), build.placements)
        return ExpertParallelHooks()


def check_pipeline_chunks(layout: Layout, n_layers: int, virtual_stages: int = 1, schedule: str = "1f1b") -> None:
    """Each pipeline chunk gets a layer; virtual stages need the interleaved schedule."""
    chunks = layout.pp * virtual_stages
    if chunks > n_layers:
        raise LayoutError(f"pp×virtual_stages = {chunks} exceeds model.n_layers ({n_layers}); each chunk needs a layer")
    if virtual_stages > 1 and schedule != "interleaved":
        raise LayoutError(f"parallel.virtual_stages={virtual_stages} needs parallel.schedule = 'interleaved'")


def check_pipeline_schedule(layout: Layout, n_micro: int, schedule: str = "1f1b") -> None:
    """Enough micro-batches per replica for the schedule."""
    pp = layout.pp
    if pp > 1 and schedule in ("1f1b", "interleaved", "zb1") and n_micro < pp:
        raise LayoutError(
            f"schedule {schedule} needs at least pp={pp} micro-batches per replica, got {n_micro} "
            f"(set train.micro_batch so that the per-replica batch splits into at least {pp})"
        )
    if schedule == "interleaved" and pp > 1 and n_micro % pp:
        raise LayoutError(f"interleaved schedule needs micro-batches per replica ({n_micro}) divisible by pp={pp}")


class PipelineParallel:
    """meshlm.parallel.pipeline: this rank keeps its stage(s) of the plan's layers; a schedule runs them."""

    dim = "pp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.pp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        n_layers = spec.n_layers or (spec.model.n_layers if spec.model is not None else 1)
        check_pipeline_chunks(spec.layout, n_layers, spec.options.virtual_stages, spec.options.schedule)
        check_pipeline_schedule(spec.layout, spec.n_micro, spec.options.schedule)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.pipeline import check_stage_forwards, hidden_size
        from meshlm.parallel.plan import check_pipeline_split

        check_pipeline_split(model, plan, layout.pp)
        hidden_size(model, plan.pipeline)
        check_stage_forwards(model, plan, layout.pp * options.virtual_stages)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.pipeline import PipelineSchedule, TiedStages, hidden_size, split_model
        from meshlm.parallel.runtime import PipelineHooks

        mesh, options, engine = build.mesh, build.options, build.engine
        layout = mesh.layout
        build.chunks = split_model(
            build.model,
            mesh.rank("pp"),
            layout.pp,
            options.virtual_stages,
            plan=build.plan,
            placements=build.placements,
        )
        build.pipeline = PipelineSchedule(
            build.chunks,
            mesh.group("pp"),
            schedule=options.schedule,
            n_micro=options.micro_batches,
            loss_fn=engine._scaled_loss,
            autocast=engine.autocast,
            set_grad_sync=engine.set_grad_sync,
            seq_shards=layout.tp if options.sequence_parallel else 1,
            hidden_size=hidden_size(build.model, build.plan.pipeline),
        )
        build.tied = TiedStages.build(build.model, build.chunks, build.plan.pipeline, mesh, build.placements)
        if build.tied is not None and build.tied.replica:  # the first stage counts and writes a tied weight
            for p in build.tied.params:
                build.placements.record(p, counted=False)
        return PipelineHooks(build.pipeline, build.tied, build)


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


class DataParallelism:
    """meshlm.parallel.data_parallel: replicas average their gradients (overlapped, bucketed); ZeRO 1-3 shards
    optimizer state, gradients and weights. Always applied: at one replica without ZeRO it only materialises a
    meta-built model on the device."""

    dim = "dp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        spec.n_micro  # noqa: B018 — the property raises the one-line LayoutError

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.plan import check_zero3_units

        if options.zero == 3:
            check_zero3_units(model, plan)

    def apply(self, build: Build) -> Applied:
        import torch

        from meshlm.parallel.data_parallel import DataParallel, replica_group, zero_param_dtype
        from meshlm.parallel.distributed import AUTOCAST_DTYPES
        from meshlm.parallel.gradients import LocalGradients
        from meshlm.parallel.runtime import DataParallelHooks

        mesh, options = build.mesh, build.options
        replicas = mesh.size("data") * mesh.size("cp")
        packed = replicas > 1 or options.zero > 0  # data parallel / ZeRO lays the parameters out
        if build.meta_init is not None:
            build.meta_init.replace_params(build.model, build.chunks, packed, packs_frozen=options.zero == 3)
        if packed:
            build.dp = DataParallel(
                build.chunks,
                replica_group(mesh),
                zero=options.zero,
                bucket_mb=options.bucket_mb,
                shard_group_size=options.zero_shard_size,
                param_dtype=zero_param_dtype(options, build.device_type, AUTOCAST_DTYPES.get(options.autocast_dtype)),
                reduce_dtype=torch.bfloat16 if options.zero_reduce_dtype == "bf16" else torch.float32,
                plan=build.plan,
                source=build.meta_init,
                expert_group=mesh.group("dp_cp") if mesh.layout.ep > 1 else None,
                placements=build.placements,
            )
        if build.meta_init is not None:
            build.meta_init.check_done()
        build.grads = build.dp or LocalGradients(build.chunks)
        return DataParallelHooks(build.grads, mesh)


class FP8(Transform):
    """meshlm.parallel.fp8: the blocks' Linear layers multiply in fp8 (tensorwise dynamic scales); a module swap
    on what the strategies above left (tp's sharded linears keep their collectives), same parameters, so data
    parallel's buffers and hooks stay. Not exact against one process by design (each rank scales its own
    operands): tests/test_fp8.py bounds it."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.fp8 import apply_fp8

        if build.options.fp8:
            apply_fp8(build.chunks, build.plan, emulate=build.options.fp8 == "emulate")


class Compile(Transform):
    """meshlm.parallel.compile: torch.compile each block this rank holds, last, so the graphs are of the modules
    that run (tp's collectives inside, pipeline sends and ZeRO-3 gathers between blocks, eager)."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.compile import compile_blocks

        if build.options.compile:
            compile_blocks(build.chunks, build.plan, build.options.compile_backend)


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
        from meshlm.parallel.plan import plan_for

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


def apply_strategies(build: Build, model_transforms: bool = False) -> list[Applied]:
    """Every enabled strategy's transform, in composition order; their run-time hooks, in the same order. With
    `model_transforms`, only the transforms of the plain model (ModelTransform: Adapt), which the engine
    applies before its checks; without, all the others."""
    build.chunks = [build.model]
    return [
        s.apply(build)
        for s in STRATEGIES
        if isinstance(s, ModelTransform) == model_transforms and s.enabled(build.mesh.layout, build.options)
    ]


__all__ = [
    "STRATEGIES",
    "Adapt",
    "Build",
    "LayoutSpec",
    "ModelTransform",
    "Strategy",
    "apply_strategies",
    "check_layout",
]
