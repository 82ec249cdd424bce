"""The planner's memory predictions match what meshlm's real training step holds, rank by rank.

One gloo group per world size (1, 2, 4) trains every layout of that size for one step of the `test` model and
reports, per rank, the model-state bytes right after the optimizer step and the peak activation bytes autograd
saved for backward (benchmarks/planner_check.py, which also times steps). The planner (fp32, as meshlm runs on
CPU) must be within 10 % of:
  * every rank's params + grads + optimizer state (its pipeline stage's Ψ, sharded by ZeRO);
  * the worst rank's model states, against what `memory()` reports for the fullest stage;
  * the worst rank's saved activations, against `memory()`'s activations + logits less the fused loss's running
    chunk (all but ZeRO-3: it frees gathered weights by resizing their storage, which the activation meter
    cannot see, so it counts them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # after tests/: its names win

from distributed import run_distributed
from planner_check import Case, measure_cases, predict, stage_model_states

from meshlm.model import preset
from meshlm.plan.memory import Workload, loss_chunk_bytes

TOLERANCE = 0.10
MODEL = preset("test")
BATCH, MICRO_BATCH, SEQ_LEN = 8, 2, 32
CASES = [
    Case("dp=1"),
    Case("dp=2", 0),
    Case("dp=2", 1),
    Case("dp=2", 2),
    Case("dp=2", 3),
    Case("dp=1,tp=2"),
    Case("pp=2,dp=1"),
    Case("pp=2,dp=1", schedule="gpipe"),
    Case("dp=2,tp=2", 2),
    Case("pp=2,dp=2", 1),
    Case("pp=2,dp=1,tp=2"),
    Case("pp=4,dp=1"),
]


@pytest.fixture(scope="module")
def measured() -> dict[Case, list[dict]]:
    """Case -> per-rank measurements, one process group per world size."""
    out: dict[Case, list[dict]] = {}
    for world in sorted({c.world() for c in CASES}):
        group = [c for c in CASES if c.world() == world]
        args = (group, MODEL, BATCH, MICRO_BATCH, SEQ_LEN, 0, 0, False)
        results = run_distributed(measure_cases, world, *args, timeout=120)
        for i, case in enumerate(group):
            out[case] = [r["cases"][i] for r in results]
    return out


def within(predicted: float, measured: float) -> bool:
    return abs(predicted / measured - 1) <= TOLERANCE


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_model_states_every_rank(measured: dict, case: Case) -> None:
    layout, _ = predict(case, MODEL, BATCH, MICRO_BATCH, SEQ_LEN, None)
    for rank, r in enumerate(measured[case]):
        predicted, got = stage_model_states(MODEL, layout, r["pp_rank"]), sum(r["states"].values())
        assert within(predicted, got), f"rank {rank} (stage {r['pp_rank']}): planner {predicted} B, held {got} B"


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_reported_memory_is_the_fullest_rank(measured: dict, case: Case) -> None:
    layout, plan = predict(case, MODEL, BATCH, MICRO_BATCH, SEQ_LEN, None)
    mem = plan.memory
    states = max(sum(r["states"].values()) for r in measured[case])
    assert within(mem.params + mem.grads + mem.optimizer, states), (mem, states)
    if case.zero == 3:
        return  # gathered weights are freed by storage resize, invisible to the activation meter
    activations = max(r["activations"] for r in measured[case])
    # the fused loss's running chunk is memory at its peak (on the last stage), not saved for backward
    chunk = loss_chunk_bytes(Workload(MODEL, SEQ_LEN, BATCH, 1e9, "fp32"), layout) if mem.logits else 0.0
    assert within(mem.activations + mem.logits - chunk, activations), (mem, activations)


def test_the_check_can_fail(measured: dict) -> None:
    """The measurements tell layouts apart: a planner that ignored ZeRO or pipeline splits would fail above."""
    held = {case: max(sum(r["states"].values()) for r in measured[case]) for case in CASES}
    assert held[Case("dp=2", 3)] < held[Case("dp=2", 1)] < held[Case("dp=2", 0)]
    assert not within(held[Case("dp=2", 0)], held[Case("pp=2,dp=1")])
    gpipe = max(r["activations"] for r in measured[Case("pp=2,dp=1", schedule="gpipe")])
    one_f_one_b = max(r["activations"] for r in measured[Case("pp=2,dp=1")])
    assert not within(gpipe, one_f_one_b)
