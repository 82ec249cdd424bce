"""ZeRO-3's plan rule: the plan's zero3_units checked against a model (meshlm.parallel.parallel_plan's
zero3_unit_groups reads them for data parallel's flat buffers)."""

from __future__ import annotations

from torch import nn

from meshlm.parallel.parallel_plan import ParallelPlan, PlanError, matches_unit, module_examples


def check_zero3_units(model: nn.Module, plan: ParallelPlan) -> None:
    """Every entry of the plan's zero3_units matches a module name or class of `model`."""
    cls = type(model).__name__
    names = dict(model.named_modules())
    for entry in plan.zero3_units:
        patterns = entry if isinstance(entry, tuple) else (entry,)
        for pattern in patterns:
            if not any(matches_unit(n, m, (pattern,)) for n, m in names.items() if n):
                raise PlanError(
                    f"plan {plan.name!r}: zero3_units entry {pattern!r} matches no module name or class of "
                    f"{cls} (modules: {module_examples(names)})"
                )
