"""Pipeline parallel's plan rules: the plan's PipelineSplit checked against a model (every parameter in a
stage, ties only between the two ends)."""

from __future__ import annotations

from torch import nn

from meshlm.parallel.parallel_plan import ParallelPlan, PlanError


def check_pipeline_split(model: nn.Module, plan: ParallelPlan, n_stages: int) -> None:
    """Every parameter must belong to a block, a first-stage or a last-stage module; with several stages a
    tied parameter may be shared by first- and last-stage modules only."""
    cls = type(model).__name__
    split = plan.pipeline
    if split is None:
        raise PlanError(f"plan {plan.name!r} for {cls} has no pipeline split; pp > 1 needs PipelineSplit(...)")
    names = dict(model.named_modules())
    for part in (split.layers, *split.first, *split.last):
        if part not in names:
            raise PlanError(f"plan {plan.name!r}: pipeline module {part!r} does not exist in {cls}")
    if not isinstance(names[split.layers], (nn.ModuleList, nn.ModuleDict)):
        raise PlanError(f"plan {plan.name!r}: pipeline layers {split.layers!r} must be an nn.ModuleList or ModuleDict")
    owners = (split.layers, *split.first, *split.last)
    for pname, _ in model.named_parameters(remove_duplicate=False):
        if not any(pname.startswith(owner + ".") for owner in owners):
            raise PlanError(
                f"plan {plan.name!r}: parameter {pname} of {cls} is in no pipeline stage; add its module to "
                f"PipelineSplit.first or .last (now first={list(split.first)}, last={list(split.last)})"
            )
    # A parameter shared by the first and the last stage's modules (a tied embedding and head) lives on both
    # stages, its gradients summed between them (pipeline.TiedStages). Any other sharing across parts (a block
    # with another block or with an end) would put one weight on stages with no such sum: refused.
    part_of: dict[int, tuple[str, str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if pname.startswith(split.layers + "."):
            part = split.layers + "." + pname[len(split.layers) + 1 :].split(".")[0]
        else:
            part = "first" if any(pname.startswith(n + ".") for n in split.first) else "last"
        seen = part_of.setdefault(id(p), (part, pname))
        if n_stages > 1 and seen[0] != part and {seen[0], part} != {"first", "last"}:
            raise PlanError(
                f"plan {plan.name!r}: {seen[1]} and {pname} of {cls} are one tied parameter in two pipeline parts; "
                "only a tie between PipelineSplit.first and .last modules (embedding and head) can be pipelined"
            )
