"""The parallel layer's contract (meshlm.parallel.strategies): every parallelism is one Strategy with a size check
(shared by the config and the planner), a model check and an apply, composed by ParallelModel in one loop."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable

import pytest
import torch

from meshlm.model import Transformer, preset
from meshlm.parallel import strategies
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.plan import PlanError
from meshlm.parallel.runtime import Applied
from meshlm.parallel.strategies import STRATEGIES, LayoutSpec, ModelTransform, check_layout
from meshlm.plan import Workload
from meshlm.plan.memory import Candidate
from meshlm.plan.search import Constraints, enumerate_strategies

MODEL = preset("test")


def test_strategies_compose_in_order() -> None:
    """Freezing and LoRA adapt the plain model first (the only transform of it: tp then shards each adapter
    with its base); tp swaps modules before the fused head sees them; pipeline splits before data parallel lays
    parameters out (and materialises a meta model); FP8 swaps the Linear layers of what runs and compilation
    comes last; data parallel and the transforms always run (each transform acts when its build asks), every
    other strategy only on its own dimension."""
    assert [s.dim for s in STRATEGIES] == ["", "tp", "", "cp", "ep", "pp", "dp", "", ""]
    model_transforms = [isinstance(s, ModelTransform) for s in STRATEGIES]
    assert model_transforms == [True] + [False] * (len(STRATEGIES) - 1)
    world1 = [type(s).__name__ for s in STRATEGIES if s.enabled(Layout(), ParallelOptions())]
    assert world1 == ["Adapt", "FusedLoss", "DataParallelism", "FP8", "Compile"]
    every = [s.dim for s in STRATEGIES if s.enabled(Layout(pp=2, tp=2, cp=2, ep=2), ParallelOptions(zero=3))]
    assert every == ["", "tp", "", "cp", "ep", "pp", "dp", "", ""]


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
    """A strategy's check is written once: adding one to STRATEGIES makes the trainer's config validation, the
    model check and the planner's search refuse the same layouts."""
    from meshlm.config import load_config
    from meshlm.train.startup import check_config

    overrides = [("model.preset", "test"), ("data.seq_len", 32), ("parallel.layout", "dp=3"), ("train.global_batch", 6)]
    cfg = load_config(None, overrides)

    def offered(dp: int) -> bool:
        c = Constraints(pp=1, dp=dp, tp=1, cp=1, zero=0, micro_batch=1, schedule="1f1b", recompute="none")
        found = enumerate_strategies(Workload(MODEL, 32, 6, 1e6), dp, dp, c)
        return any(isinstance(x, Candidate) for x in found)

    assert offered(3) and offered(2)
    check_layout(LayoutSpec(MODEL, Layout(dp=3), 6))
    check_config(cfg, 3)
    monkeypatch.setattr(strategies, "STRATEGIES", (*STRATEGIES, NoOddData()))
    with pytest.raises(LayoutError, match="dp=3 is odd"):
        check_layout(LayoutSpec(MODEL, Layout(dp=3), 6))
    with pytest.raises(LayoutError, match="dp=3 is odd"):
        check_config(cfg, 3)
    assert not offered(3) and offered(2)
    with torch.device("meta"):
        model = Transformer(MODEL)
    with pytest.raises(PlanError, match="dp=3 is odd"):
        check_layout(LayoutSpec(None, Layout(dp=3), 3), model)


def test_model_checks_run_only_for_enabled_strategies() -> None:
    """A model with no MoE layers is refused by expert parallel's check only when ep > 1."""
    with torch.device("meta"):
        model = Transformer(MODEL)
    check_layout(LayoutSpec(None, Layout(dp=2), 2), model)
    with pytest.raises(PlanError, match="no mixture-of-experts layers"):
        check_layout(LayoutSpec(None, Layout(ep=2), 2), model)


class NormCountedElsewhere:
    """A strategy of one's own that records one placement: the final norm weight is counted and written by
    another rank (as tensor parallel records for its ranks > 0)."""

    dim = ""

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        pass

    def check(self, model: object, plan: object, layout: Layout, options: ParallelOptions) -> None:
        pass

    def apply(self, build: strategies.Build) -> Applied:
        build.placements.record(build.model.model.norm.weight, counted=False)
        return Applied()  # no run-time hook of its own


def _norms_and_saved_names(toy: bool) -> tuple[float, float, list[str], list[str]]:
    """At world 1 (ZeRO-0), with or without the toy strategy before data parallel: the clipped gradient
    norm, the norm weight's own gradient norm, and the names a checkpoint writes and loads."""
    from meshlm.checkpoint.state import training_entries
    from meshlm.parallel.engine import parallelize
    from meshlm.parallel.mesh import build_mesh

    original = strategies.STRATEGIES
    if toy:
        strategies.STRATEGIES = (*original[:-1], NormCountedElsewhere(), original[-1])
    try:
        torch.manual_seed(0)
        pm = parallelize(Transformer(MODEL), build_mesh(Layout(), "cpu"))
    finally:
        strategies.STRATEGIES = original
    tagged = [(name, key) for name, p in pm.named_parameters() for key in vars(p) if "meshlm" in key]
    assert not tagged, tagged  # placement lives in pm.placements, never on a tensor
    x = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    pm.forward_backward(x[:, :-1], x[:, 1:])
    norm_weight = dict(pm.named_parameters())["model.norm.weight"]
    own = float(norm_weight.grad.norm())
    written = sorted(training_entries(pm, writer=True))
    loaded = sorted(training_entries(pm))
    return float(pm.clip_grad_norm_(0.0)), own, written, loaded


def test_a_strategys_placement_records_are_read_by_clipping_and_checkpoints() -> None:
    """The placement table is the one place readers look: a toy strategy recording the final norm weight as
    counted elsewhere takes its term out of the global gradient norm and its tensor out of what this rank
    writes (not out of what it loads), and no parameter of a built model carries a meshlm attribute."""
    from distributed import run_shared

    (plain, toy) = run_shared(_toy_strategy_runs, 1)[0]
    norm, own, written, loaded = plain
    toy_norm, toy_own, toy_written, toy_loaded = toy
    assert own == toy_own > 0
    assert abs(toy_norm**2 - (norm**2 - own**2)) <= 1e-5 * norm**2, (norm, own, toy_norm)
    assert "model/model.norm.weight" in written and loaded == written
    assert toy_written == [k for k in written if k != "model/model.norm.weight"]
    assert toy_loaded == loaded


def _toy_strategy_runs() -> tuple[tuple, tuple]:
    return _norms_and_saved_names(False), _norms_and_saved_names(True)


# A parallelism named in code: a mesh dimension or group, a strategy's module or object, a ZeRO stage.
PARALLELISM = re.compile(
    r"'(tp|ep|pp|dp|cp|data|dp_cp)'|\b(pipeline|tensor_parallel|context_parallel|expert\w*|data_parallel|zero|tied"
    r"|dp|cp|DataParallel\w*|PipelineSchedule|TiedStages)\b",
    re.IGNORECASE,
)


def _named_parallelism(function: Callable) -> list[str]:
    """The parallelisms `function`'s code names (its docstring and comments aside)."""
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        tree.body = body[1:] or [ast.Pass()]
    return [m.group(0) for m in PARALLELISM.finditer(ast.unparse(tree))]


def run_time_methods() -> list[Callable]:
    """Every method of ParallelModel but its construction: the step, the loss, the optimizer interface, state."""
    from meshlm.parallel.engine import ParallelModel

    out = []
    for name, member in vars(ParallelModel).items():
        function = getattr(member, "fget", member)
        if name != "__init__" and inspect.isfunction(function):
            out.append(function)
    return out


def test_the_engine_names_no_parallelism_in_its_run_time_methods() -> None:
    """The step (batch split, micro-batches, gradient synchronisation), the loss, clipping, the optimizer
    interface, checkpoint shards and the full state dict run the applied strategies' hooks
    (meshlm.parallel.runtime) and read the placement table; none names a parallelism."""
    methods = run_time_methods()
    assert {"forward_backward", "backward", "no_sync", "step", "local_batch", "clip_grad_norm_"} <= {
        m.__name__ for m in methods
    }
    named = {m.__name__: words for m in methods if (words := _named_parallelism(m))}
    assert not named, named


def test_the_parallelism_check_is_sharp() -> None:
    """The check reads what the engine had before its run time became hooks: a pipeline branch, the dp rows."""

    def forward_backward(self, inputs):
        if self.pipeline is not None:
            return self.pipeline.train_step(inputs)
        return None

    def local_batch(self, batch):
        """This replica's rows."""
        dp, rank = self.mesh.size("data"), self.mesh.rank("data")
        return batch[rank::dp]

    def sum_tied(self):
        return self.tied is None

    assert _named_parallelism(forward_backward) == ["pipeline", "pipeline"]
    assert _named_parallelism(local_batch) == ["dp", "'data'", "'data'", "dp"]
    assert _named_parallelism(sum_tied) == ["tied"]


class CountedChecks:
    """A strategy of one's own that only counts how often a build checks the layout and the model."""

    dim = ""

    def __init__(self) -> None:
        self.calls = {"sizes": 0, "model": 0}

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        self.calls["sizes"] += 1

    def check(self, model: object, plan: object, layout: Layout, options: ParallelOptions) -> None:
        self.calls["model"] += 1

    def apply(self, build: strategies.Build) -> Applied:
        return Applied()


def _checks_per_build() -> dict[str, int]:
    import meshlm
    from meshlm.parallel.mesh import build_mesh

    counted = CountedChecks()
    original = strategies.STRATEGIES
    strategies.STRATEGIES = (*original, counted)
    try:
        with torch.device("meta"):
            model = Transformer(MODEL)
        meshlm.parallelize(model, build_mesh(Layout(), "cpu"), {"zero": 1})
    finally:
        strategies.STRATEGIES = original
    return counted.calls


def test_a_build_checks_the_layout_and_the_model_once() -> None:
    """`meshlm.parallelize` (as the trainer) goes through the one entry point, check_layout, once: each strategy
    checks the sizes and the model a single time per build (the tp plan was checked up to three times)."""
    from distributed import run_shared

    assert run_shared(_checks_per_build, 1)[0] == {"sizes": 1, "model": 1}
