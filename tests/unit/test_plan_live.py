"""Live recovery against checkpoint restart (meshlm/plan/live.py, docs/fault-tolerance.md "Live recovery or
restart: the price"): one test per term of a group's loss (detection, re-quorum with 2 and with 3 groups, the
redone step, start-up and heal), hand-timed replays of a lost group and of every group lost at once, and the
verdict on the repository's spot trace.

Mutations that fail here (each tried): re-quorum min(join, heartbeat) also with 2 groups (`requorum_s`);
the heal at the network's rate instead of HEAL_BPS; the survivors kept at full speed while a group is down
(rate = 1 in `_LiveJob.play`); the redone step not taken off the work (`_loss`); a lone relaunched group
healing from nobody instead of restarting from the checkpoint (`_place`)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.live import (
    DETECT_S,
    HEAL_BPS,
    HEARTBEAT_TIMEOUT_S,
    LIGHTHOUSE_JOIN_TIMEOUT_S,
    LiveError,
    _LiveJob,
    fault_cost,
    replay_live,
    requorum_s,
    restart_cost_s,
)
from meshlm.plan.replay import replay
from meshlm.plan.spot import Pool, Rates
from meshlm.plan.traces import Trace, load_trace

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


RATES = Rates(0.0, 0.2, 3600.0, 100.0, 0.0, 10.0, 6.0, 2.0)  # no hardware failures; saves cost nothing
STEP_S = 10.0
HEAL_BYTES = 20 * HEAL_BPS  # a 20 s heal


def test_detection_is_the_measured_reset_of_a_killed_peer() -> None:
    """ftprobe §4: the survivors' collective failed 0.28-0.46 s after a kill -9 in five runs."""
    assert DETECT_S == 0.46 and fault_cost(3, STEP_S, 0.0, 0.0).detect_s == DETECT_S


def test_requorum_is_min_join_heartbeat_with_three_groups_and_heartbeat_with_two() -> None:
    """The lighthouse's split-brain rule: with 2 groups 1 survivor is not more than half of the 2 still
    heartbeating, so it waits for the dead one's heartbeat to expire (measured 5.4-5.7 s with H = 5 s); with
    3, 2 of 3 are, and the join timeout lets the quorum form (3.5-4.5 s with J = 3 s)."""
    assert (LIGHTHOUSE_JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S) == (
        3.0,
        5.0,
    )  # `meshlm lighthouse`'s flags in the launch files
    assert requorum_s(2) == 5.0 and requorum_s(3) == requorum_s(8) == 3.0
    assert requorum_s(3, join_s=9.0, heartbeat_s=5.0) == 5.0  # the heartbeat drops it first
    assert fault_cost(2, STEP_S, 0.0, 0.0).requorum_s == 5.0 and fault_cost(4, STEP_S, 0.0, 0.0).requorum_s == 3.0


def test_the_redone_step_heal_and_startup_terms() -> None:
    """redo = one step; heal = state bytes per rank / HEAL_BPS (295 MB/s: torchft's HTTPTransport, measured);
    start-up = what the caller passes (the planner: Rates.restart_s); total = stall + redo + down / N."""
    c = fault_cost(4, STEP_S, HEAL_BYTES, 100.0)
    assert c.redo_s == STEP_S and c.heal_s == pytest.approx(20.0) and c.startup_s == 100.0
    assert c.stall_s == pytest.approx(DETECT_S + 3.0) and c.down_s == pytest.approx(120.0)
    assert c.total_s == pytest.approx(DETECT_S + 3.0 + STEP_S + 120.0 / 4)
    with pytest.raises(LiveError, match=r"--replica-groups 1: live recovery needs at least 2 groups"):
        fault_cost(1, STEP_S, 0.0, 0.0)


def test_restart_cost_is_the_restart_the_checkpoint_read_and_half_an_interval() -> None:
    assert restart_cost_s(RATES, 600.0) == pytest.approx(100.0 + 10.0 + 300.0)


def one_loss_trace(lost: int) -> Trace:
    """2 spot nodes: `lost` of them go at 1000 s and are back at 1600 s."""
    return Trace((0.0, 1000.0, 1600.0), (0, lost, 0), 1e6, relative=True, source="hand", nodes=2)


def test_a_lost_group_costs_the_stall_the_redone_step_and_half_speed_until_it_is_back() -> None:
    """2 groups of 1 node, 5000 s of work, one save at the end. At 1000 s one node goes: stall 0.46 + 5 s,
    the step in flight (10 s at full speed) redone; the survivor trains at 1/2 until the node is back at
    1600 s, then the group relaunches (100 s start-up + 20 s heal) still at 1/2; then full speed. No
    whole-job restart; billed: the spot nodes up."""
    cost = fault_cost(2, STEP_S, HEAL_BYTES, RATES.restart_s)
    job = _LiveJob(5000.0, Pool(2, 8, spot=2), RATES, one_loss_trace(1), 5000.0, cost, random.Random(0))
    run = job.play(0.0, 1e9)
    stall_end = 1000.0 + DETECT_S + 5.0
    done = 1000.0 - STEP_S + (1600.0 - stall_end) / 2 + 120.0 / 2  # work at 1720 s
    assert run.wall_s == pytest.approx(1720.0 + 5000.0 - done) and run.restarts == 0
    assert run.usd == pytest.approx((2 * run.wall_s - 600.0) * 8 * RATES.price_spot / 3600)


def test_every_group_lost_at_once_restarts_from_the_checkpoint() -> None:
    """Both nodes go at 1000 s: no live replica holds the state, so the 1000 s since the start (no save yet)
    are lost; at 1600 s the first group restarts from the checkpoint (100 + 10 s: a whole-job restart), the
    second heals from it 20 s after it is up."""
    cost = fault_cost(2, STEP_S, HEAL_BYTES, RATES.restart_s)
    job = _LiveJob(5000.0, Pool(2, 8, spot=2), RATES, one_loss_trace(2), 5000.0, cost, random.Random(0))
    run = job.play(0.0, 1e9)
    first, second = 1600.0 + 110.0, 1600.0 + 110.0 + 20.0
    assert run.restarts == 1 and run.wall_s == pytest.approx(second + 5000.0 - (second - first) / 2)


def test_on_the_repository_trace_live_recovery_beats_restart_and_says_so_in_one_line() -> None:
    """4 spot nodes on the 0.2/node-hour trace, 100 h of work: a restart loses a 600 s restart plus the work
    since the last save at every preemption; 4 groups of 1 node lose seconds and a quarter of the throughput
    while a node is away. Live recovery is cheaper and faster at the median and says why in one line."""
    trace = load_trace(TRACES / "poisson-4node-0.2.json")
    rates = Rates(2e-5, 0.2, 3600.0, 600.0, 60.0, 60.0, 6.0, 2.0)
    restart = replay(100 * 3600.0, Pool(4, 8, spot=4), rates, trace, runs=20, seed=1)
    verdict = replay_live(100 * 3600.0, restart, rates, trace, fault_cost(4, 5.0, 2e9, 600.0), runs=20, seed=1)
    assert verdict.live.finished == 20 and verdict.live.wall_p50 < restart.wall_p50
    assert verdict.live.usd_p50 < restart.usd_p50 and verdict.recommended == "live recovery"
    line = verdict.line()
    assert "\n" not in line and line.endswith("→ live recovery") and "4 replica groups" in line
    with pytest.raises(LiveError, match=r"--replica-groups 3: the pool's 4 nodes do not split into 3 groups"):
        replay_live(100 * 3600.0, restart, rates, trace, fault_cost(3, 5.0, 2e9, 600.0), runs=2)


def test_meshlm_plan_prints_the_verdict_in_one_line_with_a_spot_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`meshlm plan --spot-trace` (how spot is replayed today) adds one line, live recovery against checkpoint
    restart on the recommended pool, and `--json` the same under replay.live_recovery; without
    `--replica-groups` the plan's own ZeRO-3-free layout picks the most groups of whole nodes (4 here)."""
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 1}))
    argv = ["plan", "--model", "test", "--gpu", "cpu", "--gpus", "4", "--calibration", str(calibration), "--top",
            "1", "--train-tokens", "2e6", "--preemption-rate", "0.2", "--preemption-per", "node-hour",
            "--replay-runs", "3", "--spot-trace", str(TRACES / "poisson-4node-0.2.json"), "--zero", "0"]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    assert run_plan(parser.parse_args(argv)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#1 on poisson-4node")]
    assert len(lines) == 1 and "live recovery (4 replica groups; a lost group costs 3.46 s" in lines[0], lines
    assert run_plan(parser.parse_args([*argv, "--json", "--replica-groups", "2"])) == 0
    live = json.loads(capsys.readouterr().out)["replay"]["live_recovery"]
    assert live["groups"] == 2 and live["requorum_s"] == HEARTBEAT_TIMEOUT_S and live["live"]["runs"] == 3


@pytest.mark.slow  # a full search of llama3-8b on 32 GPUs and 2 × 20 replays: ~10 s quiet, ~25 s under load
def test_the_docs_show_the_line_the_documented_command_prints(capsys: pytest.CaptureFixture) -> None:
    """docs/fault-tolerance.md and docs/planner.md show the verdict line of their command verbatim."""
    root = Path(__file__).resolve().parents[2]
    argv = ["plan", "--model", "llama3-8b", "--gpus", "32", "--seq-len", "4096", "--global-batch", "256",
            "--train-tokens", "3e10", "--preemption-rate", "0.05", "--preemption-per", "node-hour", "--replay-runs",
            "20", "--spot-trace", str(TRACES / "poisson-4node-0.2.json"), "--replica-groups", "4"]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    assert run_plan(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if x.startswith("#1 on poisson-4node-0.2.json: live recovery")]
    for page in ("fault-tolerance.md", "planner.md"):
        assert f"\n{line}\n" in (root / "docs" / page).read_text(), page
