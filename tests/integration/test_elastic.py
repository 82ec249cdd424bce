"""Recovery end to end, under torchrun's elastic agent with real processes.

- A rank SIGKILLed mid-training, or mid-save, is restarted by `--max-restarts` with its group; the run resumes
  from the last committed checkpoint and ends with exactly the weights of an uninterrupted run.
- A hung rank: every rank's watchdog dumps its stack and exits non-zero, so the agent (here: no restarts left)
  reports failure instead of hanging.
- Elastic membership (`--nnodes 1:2`): a second node joining mid-run makes the agent restart the group at the
  new world size, which resumes from the checkpoint resharded from dp=1 to dp=2.
Faults are injected with MESHLM_INJECT_FAULT (meshlm/faults.py), on the first attempt only.
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
from distributed import free_port, run_shared
from equivalence import trainer_runs
from run_args import small_run_args

from meshlm.checkpoint import list_checkpoints, load_model_state

pytestmark = pytest.mark.slow  # real torchrun agents, restarts and rendezvous: ~10 s each

STEPS = 8


def _args(small_run: list[str], run_dir: Path, *extra: str, steps: int = STEPS) -> list[str]:
    args = list(small_run)
    args[args.index("--log.run_dir") + 1] = str(run_dir)
    return [*args, "--train.steps", str(steps), "--checkpoint.every", "2", "--train.eval_every", "0",
            "--log.every", "1", "--fault.watchdog_s", "60", "--parallel.timeout_s", "60", *extra]  # fmt: skip


def _torchrun(launcher: list[str], args: list[str], fault: str = "", timeout: float = 400) -> subprocess.Popen:
    # pytorch#135712: torchrun's shared store keeps the last attempt's addresses; docs/fault-tolerance.md
    env = {
        **os.environ,
        "MESHLM_INJECT_FAULT": fault,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "meshlm.cli", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun still running after {timeout}s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir)[-1]
    assert newest.name == f"step_{STEPS:08d}"
    return load_model_state(newest)


STANDALONE = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
LAYOUT = ("--parallel.layout", "dp=2", "--parallel.zero", "1")


@pytest.fixture(scope="module")
def uninterrupted(data_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same training on the session's shared two-rank group: `meshlm train`'s trainer, one thread per rank
    as under torchrun, without the agent's start-up (the comparison is bit for bit, so any difference shows)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_shared(trainer_runs, 2, [_args(small_run_args(data_cache, run_dir), run_dir, *LAYOUT)], timeout=400)
    return _final_weights(run_dir)


# A rank that aborts (SIGABRT, as a C++ std::terminate) mid-training, and one SIGKILLed mid-save. (SIGKILL
# mid-training: tests/integration/test_preemption_peers.py, tests/integration/test_slurm.py.)
@pytest.mark.parametrize("fault", ["1:5:abort", "0:6:save-kill"], ids=["abort-mid-training", "kill-mid-save"])
def test_killed_rank_restarts_and_matches_uninterrupted_run(
    small_run: list[str], tmp_path: Path, uninterrupted: dict[str, torch.Tensor], fault: str
) -> None:
    out = _finish(_torchrun(STANDALONE, _args(small_run, tmp_path, *LAYOUT), fault=fault))
    if fault.endswith("abort"):  # the rank printed its Python stack before it died (meshlm.cli's faulthandler)
        assert "Fatal Python error: Aborted" in out and "in fault_point" in out, out[-4000:]
    resumed = out.split("resuming from ")[1].split()[0]  # the async save of step 4 may not have committed yet
    if fault.endswith("save-kill"):  # step 6's save died before its commit, after step 4's had finished
        assert resumed.endswith("step_00000004"), out[-4000:]
    final = _final_weights(tmp_path)
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, final[name]), name


def test_hung_rank_takes_every_rank_down_with_stacks(small_run: list[str], tmp_path: Path) -> None:
    watchdog_s = 5.0
    args = _args(small_run, tmp_path, *LAYOUT)
    args[args.index("--fault.watchdog_s") + 1] = str(watchdog_s)
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    proc = _torchrun(launcher, args, fault="1:3:hang")
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and '"step": 3, "kind": "train"' not in _text(metrics):
        time.sleep(0.2)
    hung_at = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=watchdog_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job hung instead of exiting") from None
    assert proc.returncode != 0 and time.monotonic() - hung_at < watchdog_s + 30, out[-3000:]
    for rank in (0, 1):
        assert "File " in (tmp_path / "stacks" / f"rank{rank}.txt").read_text(), f"rank {rank} wrote no stack"
    assert "fault_point" in (tmp_path / "stacks" / "rank1.txt").read_text()


def _records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in _text(metrics).splitlines() if line.endswith("}")]


def test_node_joining_restarts_the_group_at_the_new_world_size(small_run: list[str], tmp_path: Path) -> None:
    """The run is open-ended so that the join never races the end of training: once the grown group has
    trained a few steps, both agents are sent SIGTERM (a preemption: save, exit)."""
    port = free_port()
    launcher = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
                "--rdzv-conf", "last_call_timeout=1,join_timeout=120"]  # fmt: skip
    args = _args(small_run, tmp_path, steps=1_000_000)
    metrics = tmp_path / "metrics.jsonl"
    agents = [_torchrun(launcher, args)]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list_checkpoints(tmp_path):  # (older ones are pruned)
            time.sleep(0.2)
        agents.append(_torchrun(launcher, args))

        def grown_steps() -> list[int]:
            records = _records(metrics)
            joined = [i for i, r in enumerate(records) if r["kind"] == "env" and r["layout"] == "pp=1,dp=2,tp=1"]
            return [r["step"] for r in records[joined[0] :] if r["kind"] == "train"] if joined else []

        while time.monotonic() < deadline and len(grown_steps()) < 5:
            time.sleep(0.2)
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        out = "".join(agent.communicate(timeout=120)[0] for agent in agents)
    layouts = [r["layout"] for r in _records(metrics) if r["kind"] == "env"]
    assert layouts[:2] == ["pp=1,dp=1,tp=1", "pp=1,dp=2,tp=1"], (layouts, out[-3000:])
    resumed = out.split("resuming from ")[1].splitlines()[0].split()  # the grown group's rank 0, at world 2
    assert resumed[-1] == "pp=1,dp=1,tp=1)", resumed  # "... at step N (saved under pp=1,dp=1,tp=1)"
    steps = grown_steps()
    assert steps[:5] == list(range(int(resumed[3]) + 1, int(resumed[3]) + 6)), steps  # it went on from there
