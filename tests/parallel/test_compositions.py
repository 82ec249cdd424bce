"""One equivalence run per composition of two strategies, from the ordered list meshlm.parallel.strategies.STRATEGIES.

COMPOSITIONS is the fast tier's table of compositions: every pair of strategies in STRATEGIES appears in at
least one run, and each run matches the single-process run of the same global batch by the loss criterion
(tests/equivalence.py, criterion 1; criterion 2 too for an SGD run). The runs share the session's gloo groups
(tests/distributed.py `run_shared`), two ranks and four, so a case costs its training steps and no process
start. ZeRO stages vary over the cases that hold data replicas (where sharding meets the other strategy) and
one SGD run crosses the optimizer with ZeRO's sharded state. Each strategy's own test module keeps its longer
matrices (every ZeRO stage × optimizer, every schedule, the three-way compositions) in the slow tier.

`test_every_pair_of_strategies_has_a_composition` is derived from STRATEGIES itself: a strategy added to the
list fails it until a run composing it with every other strategy is added here."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from distributed import run_shared
from equivalence import assert_close_runs, reference, train_layout
from test_fused_loss import _counting_fused_calls
from test_moe import MOE_MODEL

from meshlm.parallel.contract import Strategy
from meshlm.parallel.mesh import parse_layout
from meshlm.parallel.strategies import STRATEGIES


@dataclass(frozen=True)
class Composition:
    layout: str  # every dimension given, dp included, so the world size is the product
    parallel: dict = field(default_factory=dict)  # the run config's [parallel] section
    kwargs: dict = field(default_factory=dict)  # train_layout's options (model, accumulation, optimizer)
    transforms: tuple[str, ...] = ()  # the strategies with no mesh dimension it applies, by class name

    @property
    def world(self) -> int:
        return math.prod(int(part.partition("=")[2]) for part in self.layout.split(","))


FUSED = ("FusedLoss",)
LORA = ("Adapt",)
# A strategy with no mesh dimension ("" in STRATEGIES) is engaged by a train_layout option.
TRANSFORM_OPTIONS = {"FusedLoss": {"fused_loss": True}, "Adapt": {"lora_rank": 4}}
# Transforms that no equivalence run can hold to one process's result, each with the tests that cover it.
OWN_TESTS = {
    "FP8": "each rank quantises its own operands with their own scales, so no layout is exact against one "
    "process: tests/parallel/test_fp8.py bounds it under tp=2 and ZeRO-3 (through meshlm.parallelize)",
    "Compile": "a compiled block computes what the eager one does: tests/parallel/test_compile.py trains compiled "
    "blocks (through meshlm.parallelize) as eager at world 1 and under tp=2",
}

COMPOSITIONS = {
    # two ranks: the fused-loss transform with each mesh dimension
    "tp2 sp fused": Composition("tp=2", {"sequence_parallel": True}, {}, FUSED),
    "cp2 fused": Composition("cp=2", {}, {}, FUSED),
    "ep2 zero1 fused": Composition("ep=2", {"zero": 1}, {"model_cfg": MOE_MODEL}, FUSED),
    "pp2 fused": Composition("pp=2", {}, {"micro_batch": 2}, FUSED),
    "dp2 zero3 accumulation fused": Composition("dp=2", {"zero": 3}, {"micro_batch": 2}, FUSED),
    "tp2 lora fused": Composition("tp=2", {}, {}, LORA + FUSED),
    # four ranks: every pair of mesh dimensions
    "tp2 cp2 sp": Composition("cp=2,tp=2", {"sequence_parallel": True}),
    "ep2 tp2 zero1": Composition("ep=2,tp=2", {"zero": 1}, {"model_cfg": MOE_MODEL}),
    "pp2 tp2": Composition("pp=2,tp=2", {}, {"micro_batch": 2}),
    "dp2 tp2 zero2 sp": Composition("dp=2,tp=2", {"zero": 2, "sequence_parallel": True}),
    "ep2 cp2 zero1": Composition("ep=2,cp=2", {"zero": 1}, {"model_cfg": MOE_MODEL}),
    "pp2 cp2": Composition("pp=2,cp=2", {}, {"micro_batch": 2}),
    "dp2 cp2 ulysses zero3": Composition("dp=2,cp=2", {"zero": 3, "cp_attention": "ulysses"}),
    "pp2 ep2 zero3": Composition("pp=2,ep=2", {"zero": 3}, {"model_cfg": MOE_MODEL, "micro_batch": 2}),
    "dp2 ep2 zero1 sgd": Composition("dp=2,ep=2", {"zero": 1}, {"model_cfg": MOE_MODEL, "optimizer": "sgd"}),
    "pp2 dp2 zero1": Composition("pp=2,dp=2", {"zero": 1}, {"micro_batch": 2}),
    # four ranks: LoRA with the other mesh dimensions (ZeRO-3 refuses frozen experts under ep)
    "pp2 cp2 lora": Composition("pp=2,cp=2", {}, {"micro_batch": 2}, LORA),
    "dp2 ep2 zero1 lora": Composition("dp=2,ep=2", {"zero": 1}, {"model_cfg": MOE_MODEL}, LORA),
}


def engages(case: Composition, strategy: Strategy) -> bool:
    """Whether `case` applies `strategy`: its mesh dimension has more than one rank, or, for a transform, the
    case names it (and TRANSFORM_OPTIONS says how a run turns it on)."""
    if strategy.dim:
        return getattr(parse_layout(case.layout, case.world), strategy.dim) > 1
    name = type(strategy).__name__
    return name in case.transforms and name in TRANSFORM_OPTIONS


def test_every_pair_of_strategies_has_a_composition() -> None:
    names = [strategy.dim or type(strategy).__name__ for strategy in STRATEGIES]
    missing = [
        f"{names[i]}+{names[j]}"
        for (i, a), (j, b) in itertools.combinations(enumerate(STRATEGIES), 2)
        if names[i] not in OWN_TESTS
        and names[j] not in OWN_TESTS
        and not any(engages(case, a) and engages(case, b) for case in COMPOSITIONS.values())
    ]
    assert not missing, f"no run in tests/parallel/test_compositions.py COMPOSITIONS composes {', '.join(missing)}"
    for name, case in COMPOSITIONS.items():
        assert set(case.transforms) <= set(TRANSFORM_OPTIONS), f"{name}: unknown transform in {case.transforms}"


def _train(cases: dict[str, Composition]) -> dict[str, dict]:
    """Each case's training on these ranks, with how often the fused loss ran on this rank."""
    out = {}
    for name, case in cases.items():
        options = {k: v for t in case.transforms for k, v in TRANSFORM_OPTIONS[t].items()}
        with _counting_fused_calls() as fused_calls:
            out[name] = train_layout(case.layout, case.parallel, **case.kwargs, **options)
        out[name]["fused calls"] = len(fused_calls)
    return out


def _reference(case: Composition) -> dict:
    """The single-process run of the same batches, with the same adapters: accumulation and the fused loss change
    no result."""
    adapters = TRANSFORM_OPTIONS["Adapt"] if "Adapt" in case.transforms else {}
    return reference(**{k: v for k, v in case.kwargs.items() if k != "micro_batch"}, **adapters)


@pytest.mark.parametrize("world", [2, 4])
def test_every_composition_trains_like_one_process(world: int) -> None:
    cases = {name: case for name, case in COMPOSITIONS.items() if case.world == world}
    per_rank = run_shared(_train, world, cases, timeout=900)
    for name, case in cases.items():
        got = per_rank[-1][name]  # the last rank holds the pipeline's loss
        if "FusedLoss" in case.transforms:
            assert sum(rank[name]["fused calls"] for rank in per_rank) > 0, f"{name}: the fused loss never ran"
        if "Adapt" in case.transforms:
            assert any(key.endswith(".lora_A") for key in got["state"]), f"{name}: no adapters were trained"
        try:
            assert_close_runs(_reference(case), got)
        except AssertionError as e:
            raise AssertionError(f"{name} ({case.layout} {case.parallel}): {e}") from None
