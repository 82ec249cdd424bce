"""The parallel layer's contract (meshlm.parallel.strategies): every parallelism is one Strategy with a size check
(shared by the config and the planner), a model check and an apply, composed by ParallelModel in one loop."""

from __future__ import annotations

import pytest
import torch

from meshlm.model import Transformer, preset
from meshlm.parallel import strategies
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.plan import PlanError, plan_for
from meshlm.parallel.strategies import STRATEGIES, LayoutSpec, check_model, validate_layout
from meshlm.plan import Workload
from meshlm.plan.memory import Strategy as PlannedStrategy
from meshlm.plan.search import Constraints, enumerate_strategies

MODEL = preset("test")


def test_strategies_compose_in_order() -> None:
    """tp swaps modules before the fused head sees them; pipeline splits before data parallel lays parameters
    out (and materialises a meta model); data parallel always runs, every other one only on its own dimension."""
    assert [s.dim for s in STRATEGIES] == ["tp", "", "cp", "ep", "pp", "dp"]
    world1 = [type(s).__name__ for s in STRATEGIES if s.enabled(Layout(), ParallelOptions())]
    assert world1 == ["FusedLoss", "DataParallelism"]
    every = [s.dim for s in STRATEGIES if s.enabled(Layout(pp=2, tp=2, cp=2, ep=2), ParallelOptions(zero=3))]
    assert every == ["tp", "", "cp", "ep", "pp", "dp"]


class NoOddData:
    """A strategy of one's own: refuses an odd number of data replicas."""

    dim = "xx"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        if spec.layout.dp % 2:
            raise LayoutError(f"dp={spec.layout.dp} is odd")

    def check(self, model: object, plan: object, layout: Layout, options: ParallelOptions) -> None:
        if layout.dp % 2:
            raise PlanError(f"dp={layout.dp} is odd")

    def apply(self, build: object) -> None:
        pass


def test_a_new_strategy_is_checked_by_the_runtime_and_the_planner_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy's check is written once: adding one to STRATEGIES makes the config validation, the model check
    and the planner's search refuse the same layouts."""

    def offered(dp: int) -> bool:
        c = Constraints(pp=1, dp=dp, tp=1, cp=1, zero=0, micro_batch=1, schedule="1f1b", recompute="none")
        found = enumerate_strategies(Workload(MODEL, 32, 6, 1e6), dp, dp, c)
        return any(isinstance(x, PlannedStrategy) for x in found)

    assert offered(3) and offered(2)
    validate_layout(Layout(dp=3), MODEL, global_batch=6)
    monkeypatch.setattr(strategies, "STRATEGIES", (*STRATEGIES, NoOddData()))
    with pytest.raises(LayoutError, match="dp=3 is odd"):
        validate_layout(Layout(dp=3), MODEL, global_batch=6)
    assert not offered(3) and offered(2)
    with torch.device("meta"):
        model = Transformer(MODEL)
    with pytest.raises(PlanError, match="dp=3 is odd"):
        check_model(model, plan_for(model), Layout(dp=3), ParallelOptions())


def test_model_checks_run_only_for_enabled_strategies() -> None:
    """A model with no MoE layers is refused by expert parallel's check only when ep > 1."""
    with torch.device("meta"):
        model = Transformer(MODEL)
    check_model(model, plan_for(model), Layout(dp=2), ParallelOptions())
    with pytest.raises(PlanError, match="no mixture-of-experts layers"):
        check_model(model, plan_for(model), Layout(ep=2), ParallelOptions())
