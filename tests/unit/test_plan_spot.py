"""Spot and failure economics (meshlm/plan/spot.py, docs/planner.md "Spot, failures and cost"): the job-level
interruption rate from the per-node rate and N, Young/Daly checkpointing, availability with hot spares,
elastic shrink, mixed pools, the recommendation, and the rule that no offering costs or takes more than on
demand without saying why. Hand-computed numbers; the large-model cases come from `meshlm plan` itself."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from meshlm.model.config import PRESETS
from meshlm.plan import Constraints, CostModel, Pool, Rates, Workload, best, compare, estimate, hardware
from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.spot import expected_wall_time, young_interval

HOUR = 3600.0
RATES = Rates(
    failure_per_gpu_hour=0.0,
    preemption_per_node_hour=0.01,
    replace_s=HOUR,
    restart_s=600.0,
    checkpoint_s=60.0,
    load_s=60.0,
    price_on_demand=6.0,
    price_spot=2.0,
)
WORK = 10 * 86400.0


def test_on_demand_is_daly_with_failures_only() -> None:
    rates = Rates(1e-4, 0.01, HOUR, 600.0, 60.0, 60.0, 6.0, 2.0)
    e = estimate(WORK, Pool(16, 8), rates)
    mtbf = 1 / (1e-4 * 8 * 16 / HOUR)
    tau = young_interval(60.0, mtbf)
    assert e.mtbi_s == pytest.approx(mtbf) and e.interval_s == pytest.approx(tau)
    assert e.wall_s == pytest.approx(expected_wall_time(WORK, tau, 60.0, 660.0, mtbf))
    assert e.usd == pytest.approx(e.wall_s / HOUR * 128 * 6.0)
    assert e.restarts == pytest.approx(e.wall_s / mtbf) and e.availability == 1.0


def test_job_interruption_rate_grows_with_the_spot_nodes() -> None:
    """Λ = λ·K: 8 spot nodes at 0.01/node-hour are interrupted every 12.5 h, 64 every 1.56 h."""
    for nodes in (8, 64):
        e = estimate(WORK, Pool(nodes, 8, spot=nodes, spares=nodes), RATES)
        assert e.mtbi_s == pytest.approx(HOUR / (0.01 * nodes))


def test_availability_is_binomial_and_spares_restore_it() -> None:
    """Each spot slot is live a fraction 1/(1 + λ·replace) = 1/1.01; all 64 together 0.53 of the time."""
    up = 1 / 1.01
    rigid = estimate(WORK, Pool(64, 8, spot=64), RATES)
    assert rigid.availability == pytest.approx(up**64)
    spared = estimate(WORK, Pool(64, 8, spot=64, spares=4), RATES)
    p_short = sum(math.comb(68, k) * up**k * (1 - up) ** (68 - k) for k in range(64))
    assert spared.availability == pytest.approx(1 - p_short)
    assert spared.wall_s < rigid.wall_s  # the spares cost 4 spot nodes but end the waiting
    assert spared.usd == pytest.approx(spared.wall_s / HOUR * 8 * 68 * up * 2.0)


def test_spot_cannot_finish_when_interruptions_outpace_restarts() -> None:
    """1024 spot nodes at 0.01/node-hour: one interruption every 5.9 min, under a restart plus a checkpoint."""
    e = estimate(WORK, Pool(1024, 8, spot=1024, spares=256), RATES)
    assert not e.feasible and math.isinf(e.wall_s) and math.isinf(e.usd)
    assert "one interruption every 5.86 min" in e.reason and "shorter than a restart plus one checkpoint" in e.reason
    never = estimate(WORK, Pool(1024, 8, spot=1024), RATES)
    assert "up together only" in never.reason  # without spares all 1024 are rarely up at once


def test_elastic_shrink_trains_on_what_is_left_and_pays_regrows() -> None:
    """Without spares an elastic pool never waits (min 32 of 64 nodes) but runs slower, and each preemption
    that finds no spare costs a regrow restart too."""
    rigid = estimate(WORK, Pool(64, 8, spot=64), RATES)
    elastic = estimate(WORK, Pool(64, 8, spot=64, min_nodes=32), RATES, speed=lambda n: n / 64)
    assert elastic.availability == pytest.approx(1.0) and elastic.speed < 1.0
    assert elastic.mtbi_s < HOUR / (0.01 * 64)  # regrows add restarts
    assert elastic.wall_s < rigid.wall_s
    assert elastic.pool.describe() == "spot, elastic 32–64 nodes"


def test_mixed_pool_bills_both_prices() -> None:
    e = estimate(WORK, Pool(8, 8, spot=4), RATES)
    up = 1 / 1.01
    assert e.usd == pytest.approx(e.wall_s / HOUR * 8 * (4 * 6.0 + 4 * up * 2.0))
    assert e.pool.describe() == "spot 4/8 nodes"


def test_compare_recommends_the_cheapest_that_meets_the_deadline() -> None:
    offers = compare(WORK, 8, 8, RATES)
    assert offers.recommended is offers.spot and offers.spot.usd < offers.on_demand.usd
    assert offers.spot.wall_s > offers.on_demand.wall_s and "takes" in offers.spot_note  # slower: says why
    tight = compare(WORK, 8, 8, RATES, deadline_s=offers.on_demand.wall_s * 1.0001)
    assert tight.recommended is tight.on_demand and tight.note.startswith("on demand is cheapest")
    missed = compare(WORK, 8, 8, RATES, deadline_s=WORK / 2)
    assert missed.recommended is missed.on_demand and missed.note.startswith("nothing finishes within 5 d")


def plan_json(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv, "--json"])


@pytest.mark.parametrize("gpus", [8192, 16384])
def test_405b_spot_says_it_cannot_finish(gpus: int, capsys: pytest.CaptureFixture) -> None:
    """The issue's example: instead of $1.75B or $37B for spot, the reason it cannot finish; on demand wins."""
    argv = ("--model", "llama3-405b", "--gpu", "h100-sxm", "--gpus", str(gpus), "--seq-len", "8192")
    argv += ("--global-batch", "2048", "--layout", "tp=8,pp=16", "--top", "1")
    assert run_plan(plan_json(*argv)) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    offers = plan["offerings"]
    assert offers["spot"]["cost_usd"] is None and offers["spot"]["note"].startswith("spot cannot finish this job")
    assert offers["recommended"] == "on demand" and plan["cost_usd"] == plan["cost_usd_on_demand"]


def test_no_offering_costs_or_takes_more_than_on_demand_without_saying_why(capsys: pytest.CaptureFixture) -> None:
    for argv in (
        ("--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--global-batch", "512", "--top", "5"),
        ("--model", "llama3-8b", "--gpus", "8,64", "--seq-len", "8192", "--objective", "cost", "--top", "5"),
    ):
        assert run_plan(plan_json(*argv)) == 0
        for plan in json.loads(capsys.readouterr().out)["plans"]:
            o = plan["offerings"]
            od = o["on_demand"]
            for name in ("spot", "mixed"):
                e = o[name]
                if e is None:
                    continue
                worse = e["cost_usd"] is None or e["cost_usd"] > od["cost_usd"] or e["wall_days"] > od["wall_days"]
                assert bool(e["note"]) == worse, (name, e)


def test_cost_objective_with_deadline_prefers_what_finishes() -> None:
    w = Workload(PRESETS["llama3-1b"], 2048, 256, 2e10)
    hw = hardware("H100-SXM")
    c = Constraints(pp=1, tp=1)
    free = best(w, [8, 64], hw, objective="cost", constraints=c)
    soon = best(w, [8, 64], hw, objective="cost", constraints=c, costs=CostModel(deadline_s=free.cost.wall_s / 4))
    assert soon.strategy.gpus == 64 and soon.cost.wall_s <= free.cost.wall_s / 4
