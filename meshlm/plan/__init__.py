"""The planner: predict memory, step time and cost of every parallel strategy, and pick one.

    from meshlm.plan import Workload, best, hardware
    plan = best(Workload(preset("llama3-70b"), 8192, 1024, 15e12), 64, hardware("H100-SXM"))

Formulas, sources, the calibration schema and a comparison with published runs: docs/planner.md.
"""

from meshlm.plan.cost import CostModel, run_cost
from meshlm.plan.hardware import GPUS, Calibration, Hardware, Link, hardware
from meshlm.plan.memory import Assumptions, Candidate, Memory, Workload, memory
from meshlm.plan.network import collective_time
from meshlm.plan.search import (
    Constraints,
    Plan,
    PlannerError,
    SearchResult,
    best,
    plan_for_config,
    plan_strategy,
    search,
)
from meshlm.plan.spot import Estimate, Offerings, Pool, Rates, compare, estimate, young_interval
from meshlm.plan.step_time import StepTime, bubble_fraction, step_time

__all__ = [
    "GPUS",
    "Assumptions",
    "Calibration",
    "Candidate",
    "Constraints",
    "CostModel",
    "Estimate",
    "Hardware",
    "Link",
    "Memory",
    "Offerings",
    "Plan",
    "PlannerError",
    "Pool",
    "Rates",
    "SearchResult",
    "StepTime",
    "Workload",
    "best",
    "bubble_fraction",
    "collective_time",
    "compare",
    "estimate",
    "hardware",
    "memory",
    "plan_for_config",
    "plan_strategy",
    "run_cost",
    "search",
    "step_time",
    "young_interval",
]
