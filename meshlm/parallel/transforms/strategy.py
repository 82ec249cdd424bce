"""The transforms: strategies with no mesh dimension, no size or model rules and no run-time hook, which change
the modules that run when their build asks for it (imports no torch). Adapt (freezing and LoRA,
meshlm.parallel.transforms.lora) is a transform of the plain model, applied before anything checks or records
it; FusedLoss (meshlm.parallel.transforms.fused_loss) fuses the head with the cross-entropy after tensor
parallel; FP8 (transforms.fp8) and Compile (transforms.compile) change the blocks that run, last."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


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
    """meshlm.parallel.transforms.lora: train.freeze's parameters frozen and LoRA adapters wrapped around the
    targets (`build.adaptation`), first, so tensor parallel shards each adapter with its base and data parallel
    packs, reduces and shards only what trains. Under bf16 autocast the frozen Linear weights are kept in bf16
    (autocast casts them at each use anyway: the same numbers, half the bytes)."""

    def transform(self, build: Build) -> None:
        import torch

        from meshlm.parallel.transforms.lora import cast_frozen_linears

        if build.adaptation is not None:
            build.adaptation.apply(build.model, build.plan)
        if build.options.autocast_dtype == "bf16":
            cast_frozen_linears(build.model, torch.bfloat16)


class FusedLoss(Transform):
    """meshlm.parallel.transforms.fused_loss: the vocabulary head and meshlm's cross-entropy computed together,
    chunk by chunk (vocabulary-parallel after tensor parallel). Only for meshlm's own loss on logits it never
    returns. Under ZeRO-3 the head's unit stays gathered until the fused loss has run (docs/zero.md)."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.transforms.fused_loss import apply_fused_loss

        if build.loss.fused and build.loss.fn is None and not build.loss.gather_logits:
            backend = build.options.compile_backend if build.options.compile else None
            apply_fused_loss(build.model, build.plan, backend)  # the chunk body compiled with the blocks


class FP8(Transform):
    """meshlm.parallel.transforms.fp8: the blocks' Linear layers multiply in fp8 (tensorwise dynamic scales); a
    module swap on what the strategies above left (tp's sharded linears keep their collectives), same
    parameters, so data parallel's buffers and hooks stay. Not exact against one process by design (each rank
    scales its own operands): tests/parallel/test_fp8.py bounds it."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.transforms.fp8 import apply_fp8

        if build.options.fp8:
            apply_fp8(list(build.chunks), build.plan, emulate=build.options.fp8 == "emulate")


class Compile(Transform):
    """meshlm.parallel.transforms.compile: torch.compile each block this rank holds, last, so the graphs are of
    the modules that run (tp's collectives inside, pipeline sends and ZeRO-3 gathers between blocks, eager)."""

    def transform(self, build: Build) -> None:
        from meshlm.parallel.transforms.compile import compile_blocks

        if build.options.compile:
            compile_blocks(list(build.chunks), build.plan, build.options.compile_backend)
