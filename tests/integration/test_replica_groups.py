"""Fault-tolerant replica groups (issue #52) end to end: `meshlm lighthouse` and one `meshlm train` per group, real
processes on CPU gloo, the tiny `test` model.

Each run ends with every group's final checkpoint bit-identical to the others' AND to the one-process replay of the
schedule of live groups it logged (tests/replica_replay.py: each step's chunks backpropagated one by one and summed
in quorum order): a group killed with SIGKILL and relaunched, or stopped with SIGSTOP, heals from a live peer,
while the survivors keep stepping on the smaller batch and name the lost group in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import free_port

from meshlm.checkpoint import list_checkpoints, load_model_state

pytestmark = pytest.mark.slow  # lighthouse + 2-3 groups + a relaunch: ~40-60 s per scenario on 2 cores

pytest.importorskip("torchft", reason="replica groups need the extra meshlm[ft] (torchft-nightly)")

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
# The ladder at test scale (docs/fault-tolerance.md): heartbeat 5 s, join 3 s, collectives 5 s, quorum 60 s
TIMEOUTS = ("--fault.collective_timeout_s", "5", "--fault.quorum_timeout_s", "60")
# Start-up under two CPU burners took up to 64 s in the probe; no scenario here needs more than this
DEADLINE_S = 240.0


def _args(small_run: list[str], run_dir: Path, groups: int, lighthouse: int, *extra: str) -> list[str]:
    args = list(small_run)
    args[args.index("--log.run_dir") + 1] = str(run_dir)
    return [*args, "--train.steps", str(STEPS), "--checkpoint.every", "5", "--train.eval_every", "0",
            "--log.every", "1", "--fault.replica_groups", str(groups), "--fault.lighthouse", f"localhost:{lighthouse}",
            *TIMEOUTS, *extra]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _lighthouse(port: int, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "meshlm.cli", "lighthouse", "--port", str(port), "--min-replicas", "1",
           "--join-timeout-s", "3", "--heartbeat-timeout-s", "5"]  # fmt: skip
    return subprocess.Popen(cmd, env=_env(), stdout=out.open("a"), stderr=subprocess.STDOUT)


def _group(g: int, args: list[str], out: Path, **env: str) -> subprocess.Popen:
    """Group g as one process (a group of one rank: torchrun's environment, its own store port)."""
    group_env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), MESHLM_REPLICA_GROUP=str(g), **env)  # fmt: skip
    cmd = [sys.executable, "-m", "meshlm.cli", "train", *args]
    return subprocess.Popen(cmd, env=group_env, stdout=out.open("a"), stderr=subprocess.STDOUT)


def _committed(run_dir: Path, g: int) -> int:
    """The newest step group g logged as trained (log.every 1)."""
    path = run_dir / f"group-{g}" / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if '"kind": "train"' in line]
    return max(steps, default=0)


def _wait_step(run_dir: Path, g: int, step: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while _committed(run_dir, g) < step:
        assert all(p.poll() in (None, 0) for p in procs), "a group exited early"
        assert time.monotonic() < deadline, f"group {g} did not reach step {step}"
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    for proc, log in zip(procs, logs, strict=True):
        try:
            code = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"still running:\n{log.read_text()[-3000:]}") from None
        assert code == 0, log.read_text()[-3000:]


def _replay(args: list[str], groups: int, out: Path) -> dict[str, torch.Tensor]:
    cmd = [sys.executable, str(REPO / "tests" / "replica_replay.py"), str(out), str(STEPS), str(groups), *args]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return torch.load(out)


def _final(run_dir: Path, g: int) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / f"group-{g}")[-1]
    assert newest.name == f"step_{STEPS:08d}"
    return load_model_state(newest)


def _assert_bitwise(run_dir: Path, groups: int, reference: dict[str, torch.Tensor]) -> None:
    """Every group's final weights equal the replay's, bit for bit (no tolerance: the same additions in the
    same order; a heal copies bytes)."""
    for g in range(groups):
        final = _final(run_dir, g)
        assert final.keys() <= reference.keys()
        for name, weight in final.items():
            assert torch.equal(weight, reference[name]), f"group {g}: {name} differs from the one-process replay"


def test_killed_group_is_relaunched_and_heals_from_a_peer(small_run: list[str], tmp_path: Path) -> None:
    """Two groups; group 1 killed with SIGKILL at step 10 and relaunched at once. Group 0 names it in one line
    and keeps stepping alone (half the batch); the relaunch resumes from its own checkpoint (step 10 at most),
    heals from group 0 and both finish at full strength. Mutation: Across.sum_ summing in arrival order
    (outs reversed on group 1) makes the weights differ from the replay; a heal that skips the optimizer state
    (`_tensors` without the state) makes group 1's final weights differ from group 0's."""
    run_dir, port = tmp_path / "run", free_port()
    args = _args(small_run, run_dir, 2, port)
    logs = [tmp_path / "lighthouse.log", tmp_path / "g0.log", tmp_path / "g1.log"]
    lighthouse = _lighthouse(port, logs[0])
    slow = {"MESHLM_SHORT_STEP_SLEEP_S": "1"}  # while short of a group: so the relaunch finds group 0 running
    try:
        groups = [_group(0, args, logs[1], **slow), _group(1, args, logs[2], **slow)]
        _wait_step(run_dir, 1, 10, groups)
        groups[1].send_signal(signal.SIGKILL)
        groups[1].wait()
        groups[1] = _group(1, args, logs[2], **slow)
        _finish(groups, logs[1:])
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    survivor = logs[1].read_text()
    assert "group 1 left (dead, stalled or cut off); stepping with 1 of 2 (groups 0)" in survivor
    assert "group 1 joined; stepping with 2 of 2 (groups 0, 1)" in survivor
    assert "replica group 1: healed from a live peer at step" in logs[2].read_text()
    reference = _replay(args, 2, tmp_path / "replay.pt")
    assert (reference["__live__"] == 1).any() and reference["__live__"][-1] == 2  # it did step short, then heal
    _assert_bitwise(run_dir, 2, reference)
