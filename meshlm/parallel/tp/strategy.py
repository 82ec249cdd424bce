"""Tensor parallel's Strategy (imports no torch: its size rules, meshlm.parallel.tp.sizes, run in `meshlm plan` and
the run config's validation). Its plan rules are meshlm.parallel.tp.rules, its mechanics meshlm.parallel.tp.sharding
(with tp.ops, tp.moe and the build-time probe tp.probe), its run-time hook
meshlm.parallel.cuts.GatherCuts over "tp"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.tp.sizes import check_tensor_parallel

if TYPE_CHECKING:
    import torch
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


class TensorParallel:
    """meshlm.parallel.tp.sharding: the plan's Linear/Embedding modules sharded over `tp` (a Shard each)."""

    dim = "tp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.tp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        if spec.model is not None:
            check_tensor_parallel(spec.model, spec.layout.tp, spec.seq_len, spec.options.sequence_parallel)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.tp.probe import probe_tensor_parallel
        from meshlm.parallel.tp.rules import check_tp_plan

        check_tp_plan(model, plan, layout.tp, options.sequence_parallel)
        probe_tensor_parallel(model, plan, layout.tp)  # each distinct block split vs whole (docs/api.md)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.cuts import GatherCuts
        from meshlm.parallel.tp.sharding import apply_tensor_parallel, vocab_parallel_cross_entropy

        tp = apply_tensor_parallel(
            build.model, build.mesh.group("tp"), build.placements, build.options.sequence_parallel, build.plan
        )
        for m in build.model.modules():
            if getattr(m, "vocab_head", False):
                m.gather_output = build.loss.gather_logits
        hooks = GatherCuts(build.mesh, build.placements, "tp")
        if build.loss.fn is None and not build.loss.gather_logits:
            ignore_index = build.loss.ignore_index

            def tp_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
                logits = getattr(output, "logits", output)
                return vocab_parallel_cross_entropy(logits, targets, tp.group, ignore_index)

            hooks.token_loss = tp_loss
        return hooks
