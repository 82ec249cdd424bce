"""The planner and the runtime check layouts with the same functions: over a generated grid of layouts (world
sizes, pp/dp/ep/cp/tp, schedules, virtual stages, micro-batches, sequence lengths, head counts, dense and
mixture-of-experts models, sequence parallel, cp attention) the planner's search accepts exactly the layouts
the trainer accepts: its `check_layout` (sizes only), then the check ParallelModel makes of the model against its
parallel plan before any work (`check_layout` with the model: every enabled strategy's `check`)."""

from __future__ import annotations

import functools
import importlib
import itertools
import random

import pytest
import torch

from meshlm.model import Transformer, preset
from meshlm.model.config import ModelConfig
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import PlanError
from meshlm.parallel.strategies import STRATEGIES, check_layout
from meshlm.plan import Workload
from meshlm.plan.memory import Candidate
from meshlm.plan.search import Constraints, enumerate_strategies

search_module = importlib.import_module("meshlm.plan.search")  # meshlm.plan.search is also a function's name

WORLDS = (1, 2, 4, 6, 8)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")
HEADS = ((4, 2), (6, 3), (8, 8), (4, 4))  # (n_heads, n_kv_heads); dim 96 splits into each
EXPERTS = (0, 4)  # a dense model, or every layer a mixture of 4 experts (top-2): ep 1, 2 and 4 divide it
GRID_SIZE = 2000  # sampled from the full product (~10⁶), fixed seed: the same grid every run


def meshes(world: int) -> list[Layout]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [
        Layout(pp, world // (pp * cp * tp * ep), tp, cp, ep)
        for pp, cp, tp, ep in itertools.product(divisors, repeat=4)
        if world % (pp * cp * tp * ep) == 0
    ]


def grid() -> list[tuple[Layout, Candidate, ModelConfig, int, int]]:
    """(mesh, strategy, model, seq_len, global_batch) samples."""
    rng = random.Random(0)
    full = [
        (mesh, schedule, v, micro, seq, heads, experts, sp, attention, batch)
        for world in WORLDS
        for mesh in meshes(world)
        for schedule in SCHEDULES
        for v in (1, 2)
        for micro in (1, 2, 3)
        for seq in (24, 32, 64)
        for heads in HEADS
        for experts in EXPERTS
        for sp in (False, True)
        for attention in ("ring", "ulysses")
        for batch in (6, 8)
    ]
    out = []
    for mesh, schedule, v, micro, seq, (heads, kv), experts, sp, attention, batch in rng.sample(full, GRID_SIZE):
        model = preset("test").replace(dim=96, n_heads=heads, n_kv_heads=kv, max_seq_len=64)
        if experts:
            model = model.replace(hf_model_type="mixtral", n_experts=experts, top_k=2, moe_intermediate_size=64)
        options = ParallelOptions(schedule=schedule, virtual_stages=v, sequence_parallel=sp, cp_attention=attention)
        strategy = Candidate(mesh, options, micro)
        out.append((mesh, strategy, model, seq, batch))
    return out


@functools.cache
def meta_model(model: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(model)


def runtime_accepts(strategy: Candidate, model: ModelConfig, seq_len: int, global_batch: int) -> bool:
    """What the trainer decides before any work: check_config (meshlm.parallel.strategies.check_layout, sizes
    only), then ParallelModel's check of the model against its parallel plan at this layout (check_layout with
    the model)."""
    s = strategy
    try:
        check_layout(LayoutSpec(model, s.mesh, global_batch, s.micro_batch, seq_len, s.options))
    except (LayoutError, PlanError):
        return False
    return model_accepted(model, s.mesh, s.zero, s.sequence_parallel, s.cp_attention)


@functools.cache
def model_accepted(model: ModelConfig, mesh: Layout, zero: int, sequence_parallel: bool, cp_attention: str) -> bool:
    """ParallelModel's check of the model against its plan (check_layout with the model, at a batch of pp
    micro-batches, which every schedule takes), which reads only these: once per
    distinct set (a search's plans share them by the thousand; each check probes every pipeline stage)."""
    net = meta_model(model)
    options = ParallelOptions(zero=zero, sequence_parallel=sequence_parallel, cp_attention=cp_attention)
    try:
        check_layout(LayoutSpec(None, mesh, mesh.data_parallel * mesh.pp, 1, options=options), net)
    except (LayoutError, PlanError):
        return False
    return True


def planner_accepts(strategy: Candidate, model: ModelConfig, seq_len: int, global_batch: int) -> bool:
    """Whether the planner's search offers this strategy when every choice is fixed to it (the GPUs per node
    set to the world, so its one planner-only preference, tp within a node, never applies)."""
    s = strategy
    c = Constraints(
        pp=s.pp, dp=s.dp, tp=s.tp, cp=s.cp, ep=s.ep, zero=0, micro_batch=s.micro_batch, schedule=s.schedule,
        virtual_stages=s.virtual_stages, recompute="none", sequence_parallel=s.sequence_parallel,
        cp_attention=s.cp_attention,
    )  # fmt: skip
    found = list(enumerate_strategies(Workload(model, seq_len, global_batch, 1e6), s.gpus, s.gpus, c))
    offered = [item for item in found if isinstance(item, Candidate)]
    assert offered in ([], [s]), f"the search should try exactly {s}, it offered {offered}"
    return bool(offered)


def disagreements() -> list[str]:
    out = []
    for _, strategy, model, seq, batch in grid():
        planner, runtime = planner_accepts(strategy, model, seq, batch), runtime_accepts(strategy, model, seq, batch)
        if planner != runtime:
            heads = f"heads {model.n_heads}/{model.n_kv_heads} experts {model.n_experts}"
            out.append(f"{strategy} seq {seq} batch {batch} {heads}: planner {planner}, runtime {runtime}")
    return out


def test_grid_covers_both_verdicts_and_every_dimension() -> None:
    """The grid is not trivially one-sided: it holds accepted and refused layouts, cp and pp and tp and ep
    > 1, MoE models accepted and refused, and zb1 and interleaved layouts the runtime accepts."""
    verdicts = [(s, m, runtime_accepts(s, m, seq, b)) for _, s, m, seq, b in grid()]
    accepted = [s for s, _, ok in verdicts if ok]
    assert 0.1 < len(accepted) / len(verdicts) < 0.9
    for attribute in ("pp", "cp", "tp", "dp", "ep"):
        assert any(getattr(s, attribute) > 1 for s in accepted), attribute
    moe = [ok for s, m, ok in verdicts if m.n_experts]
    assert sum(moe) >= 20 and len(moe) - sum(moe) >= 20
    assert {s.schedule for s in accepted if s.pp > 1} == set(SCHEDULES)
    assert any(s.cp > 1 and s.cp_attention == "ulysses" for s in accepted)


def test_planner_accepts_exactly_what_the_runtime_accepts() -> None:
    assert disagreements() == []


def skipping(dim: str) -> object:
    """check_layout without the `dim` strategy's check."""

    def check(spec: LayoutSpec) -> int:
        for strategy in STRATEGIES:
            if strategy.dim != dim:
                strategy.check_layout(spec)
        return spec.n_micro

    return check


def test_a_planner_only_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharpness: a planner that skips the context-parallel strategy's check (as the search's own copy once did),
    or adds a rule of its own, disagrees with the runtime on the grid."""
    monkeypatch.setattr(search_module, "check_layout", skipping("cp"))
    assert disagreements() != []
    monkeypatch.undo()

    def stricter(spec: LayoutSpec) -> int:
        if spec.layout.cp > 1 and spec.layout.pp > 1:
            raise LayoutError("cp with pp")
        return check_layout(spec)

    monkeypatch.setattr(search_module, "check_layout", stricter)
    assert disagreements() != []


def test_a_planner_without_the_expert_parallel_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharpness: a planner that skips the expert-parallel strategy's layout check disagrees with the runtime."""
    monkeypatch.setattr(search_module, "check_layout", skipping("ep"))
    assert disagreements() != []
