"""Expert parallel's size rules and its Strategy (imports no torch). Its plan rules and mechanics are
meshlm.parallel.ep.experts (the experts sharded over `ep`, all-to-all dispatch and combine), its run-time hook
meshlm.parallel.cuts.GatherCuts over "ep"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.model.config import ModelConfig
from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


def check_expert_parallel(cfg: ModelConfig, layout: Layout) -> None:
    """Raise a one-line LayoutError if the model has no experts to split over ep or they do not split evenly
    (meshlm.parallel.ep.experts; ep composes with dp, pp, cp and tp: check_tensor_parallel splits the
    experts' hidden units). Needs no process group."""
    ep = layout.ep
    if ep == 1:
        return
    if not cfg.n_experts:
        raise LayoutError(f"parallel.layout ep={ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if cfg.n_experts % ep:
        raise LayoutError(f"model.n_experts ({cfg.n_experts}) is not divisible by ep={ep}")


class ExpertParallel:
    """meshlm.parallel.ep.experts: each rank keeps E/ep of every MoE layer's experts, reached by all-to-all."""

    dim = "ep"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.ep > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        if spec.model is not None:
            check_expert_parallel(spec.model, spec.layout)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.ep.experts import check_ep_model

        check_ep_model(model, layout, options)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.cuts import GatherCuts
        from meshlm.parallel.ep.experts import apply_expert_parallel

        apply_expert_parallel(build.model, build.mesh.group("ep"), build.placements)
        return GatherCuts(build.mesh, build.placements, "ep")
