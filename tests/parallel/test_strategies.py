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
from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import PlanError
from meshlm.parallel.strategies import STRATEGIES, check_layout
from meshlm.parallel.transforms.strategy import ModelTransform
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

    def apply(self, build: Build) -> Applied:
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


class _GatherRows(torch.autograd.Function):
    """This rank's rows of a tensor every rank of `group` uses whole: all-gathered forward; backward keeps this
    rank's rows of the (identical on every rank) gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, part: torch.Tensor, group: object) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows : (rank + 1) * rows].contiguous(), None


class _CutNorm(torch.nn.Module):
    """An RMSNorm (meshlm.model.llama) holding only this rank's rows of its weight, gathered for each forward."""

    def __init__(self, eps: float, weight: torch.nn.Parameter, group: object) -> None:
        super().__init__()
        self.eps, self.weight, self.group = eps, weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from types import SimpleNamespace

        from meshlm.model.llama import RMSNorm

        return RMSNorm.forward(SimpleNamespace(eps=self.eps, weight=_GatherRows.apply(self.weight, self.group)), x)


class CutNormOverTp:
    """A strategy of one's own that cuts a parameter: each tp rank keeps its half of the final norm weight
    (which tensor parallel leaves whole on every tp rank, counted on tp rank 0 only), gathers it for the forward,
    and records the cut in the placement table: a Shard over mesh dim "tp" along tensor dim 0, counted here."""

    dim = ""

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        pass

    def check(self, model: object, plan: object, layout: Layout, options: ParallelOptions) -> None:
        pass

    def apply(self, build: strategies.Build) -> Applied:
        from meshlm.parallel.placement import Shard

        mesh, norm = build.mesh, build.model.model.norm
        rows = norm.weight.shape[0] // mesh.size("tp")
        start = mesh.rank("tp") * rows
        half = torch.nn.Parameter(norm.weight.detach()[start : start + rows].clone(), norm.weight.requires_grad)
        build.placements.move(norm.weight, half, Shard("tp", 0, ((start, rows),)), counted=True)
        build.model.model.norm = _CutNorm(norm.eps, half, mesh.group("tp"))
        return Applied()


def _cut_run(toy: bool) -> dict:
    """At tp=2, with or without CutNormOverTp before data parallel: the loss, the clipped gradient norm, the full
    state dict, every tensor as the ranks' written checkpoint boxes put it together (with how many boxes cover
    each element), and the final norm weight as this rank holds it. The final norm weight starts at distinct
    values, so a box at the wrong offset shows."""
    import torch.distributed as dist

    from meshlm.checkpoint.state import training_entries
    from meshlm.parallel.engine import parallelize
    from meshlm.parallel.mesh import build_mesh

    torch.manual_seed(0)
    model = Transformer(MODEL)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.5, 1.5, MODEL.dim))
    original = strategies.STRATEGIES
    if toy:
        data_parallel = [type(s).__name__ for s in original].index("DataParallelism")
        strategies.STRATEGIES = (*original[:data_parallel], CutNormOverTp(), *original[data_parallel:])
    try:
        pm = parallelize(model, build_mesh(Layout(tp=2), "cpu"))
    finally:
        strategies.STRATEGIES = original
    x = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = float(pm.forward_backward(x[:, :-1], x[:, 1:]))
    boxes = [
        (key, offsets, view.detach().clone())
        for key, chunks in training_entries(pm, writer=True).items()
        for view, offsets in zip(chunks.views, chunks.offsets, strict=True)
    ]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, boxes)
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, offsets, view in (box for part in every for box in part):
        shape = pm.global_shapes[key.removeprefix("model/")]
        values, covered = saved.setdefault(key, (torch.zeros(shape), torch.zeros(shape, dtype=torch.int64)))
        where = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape, strict=True))
        values[where] += view
        covered[where] += 1
    held = dict(pm.named_parameters())["model.norm.weight"].detach().clone()
    norm = float(pm.clip_grad_norm_(0.0))
    return {"loss": loss, "norm": norm, "full": pm.full_state_dict(), "saved": saved, "held": held}


def _cut_runs() -> tuple[dict, dict, tuple[float, float]]:
    """The plain and the toy tp=2 runs, and the one-process loss and gradient norm of the same batch."""
    from meshlm.model import cross_entropy_loss

    plain, toy = _cut_run(False), _cut_run(True)
    torch.manual_seed(0)
    ref = Transformer(MODEL)
    with torch.no_grad():
        ref.model.norm.weight.copy_(torch.linspace(0.5, 1.5, MODEL.dim))
    x = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy_loss(ref(x[:, :-1]), x[:, 1:])
    loss.backward()
    norm = float(torch.stack([p.grad.double().norm() for p in ref.parameters()]).norm())
    return plain, toy, (float(loss), norm)


def test_a_strategy_that_cuts_a_parameter_is_read_by_clipping_checkpoints_and_unsharding() -> None:
    """A toy strategy that cuts a parameter touches its own class and the ordered list only: CutNormOverTp
    keeps half of the final norm weight on each tp rank and records a Shard over "tp" in the placement table.
    Every reader then gets it right from the table alone: the gradient norm counts both halves once (the
    one-process norm), each rank writes its half to a checkpoint at its own offset (the written boxes put
    together cover every element of every tensor once and equal the full weights), and full_state_dict
    gathers it (tensor parallel's unsharding is by the table's shards over "tp", whoever cut them).

    Fails under each of these mutations of a reader that bypasses the table (each tried): checkpoint boxes
    ignoring the recorded shards (meshlm.checkpoint.state.training_entries with `shards = ()`: the toy's second
    half is written over its first, and every tp slice at offset 0); clipping deciding who counts by a rule of
    its own instead of `Placement.counted` (ParallelModel._not_counted as `p.ndim == 1 and tp rank > 0`, "a
    vector is whole over tp": the second half's term is lost), or ignoring it (`return False`: tp rank 1's
    whole weights count twice); unsharding only what tensor parallel sliced (placement.unshard skipping
    parameters of 1 dim: the gathered norm weight is half long).
    Tolerances: the loss and norm of the tp=2 runs differ from one process's by fp32 summation order over tp
    shards (rel 1e-5, the project's bound); the toy moves only where values live, so against the plain tp=2
    run its loss is equal and its norm differs only in that each half's fp32 norm is rounded apart (rel 2^-24
    each: 1e-6)."""
    from distributed import run_shared

    plain, toy, (ref_loss, ref_norm) = run_shared(_cut_runs, 2)[0]
    assert toy["held"].shape == (MODEL.dim // 2,)  # the toy did cut it
    assert abs(plain["loss"] - ref_loss) <= 1e-5 * ref_loss and toy["loss"] == plain["loss"]
    assert abs(plain["norm"] - ref_norm) <= 1e-5 * ref_norm, (plain["norm"], ref_norm)
    assert abs(toy["norm"] - plain["norm"]) <= 1e-6 * plain["norm"], (toy["norm"], plain["norm"])
    assert toy["full"].keys() == plain["full"].keys()
    for name, value in plain["full"].items():
        assert torch.equal(toy["full"][name], value), name
    assert torch.equal(toy["full"]["model.norm.weight"], torch.linspace(0.5, 1.5, MODEL.dim))
    values, covered = toy["saved"]["model/model.norm.weight"]  # the toy's cut, then every tensor of both runs
    assert bool((covered == 1).all()) and torch.equal(values, torch.linspace(0.5, 1.5, MODEL.dim)), covered
    for run in (plain, toy):
        assert run["saved"].keys() == {f"model/{name}" for name in run["full"]}
        for key, (values, covered) in run["saved"].items():
            assert bool((covered == 1).all()), key
            assert torch.equal(values, run["full"][key.removeprefix("model/")]), key


# A parallelism named in code: a mesh dimension or group, a strategy's module or object, a ZeRO stage.
PARALLELISM = re.compile(
    r"'(tp|ep|pp|dp|cp|batch|expert_replicas)'|\b(pipeline|tensor_parallel|context_parallel|expert\w*|data_parallel|zero|tied"
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
    (meshlm.parallel.contract.Applied) and read the placement table; none names a parallelism."""
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
        dp, rank = self.mesh.size("batch"), self.mesh.rank("batch")
        return batch[rank::dp]

    def sum_tied(self):
        return self.tied is None

    assert _named_parallelism(forward_backward) == ["pipeline", "pipeline"]
    assert _named_parallelism(local_batch) == ["dp", "'batch'", "'batch'", "dp"]
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

    def apply(self, build: Build) -> Applied:
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
