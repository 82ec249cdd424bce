"""`meshlm launch`'s exit code as a scheduler reads it (meshlm/launch.py): 0 whenever the run ended with its
work committed, including a SIGTERM that arrives in teardown (after the last checkpoint) or before any worker
started; SIGUSR1 (a Slurm site's `--signal=USR1@…`, delivered to every task of the step) is the same notice as
SIGTERM; a stalled rank is named in the failure line. Signals are timed by events (a fault point, a record in
metrics.jsonl, the rendezvous port accepting), never by sleeps, with generous bounds."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from distributed import free_port
from test_preemption_signals import LAUNCHER, LAYOUT, SAVED, _args, _children, _finish, _start, _wait_for_train_record

from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_sigterm_in_teardown_after_the_last_checkpoint_exits_0(data_cache: str, tmp_path: Path) -> None:
    """SIGTERM to the agent and both workers once the loop is over (its last checkpoint committed): the run's
    work is done, so the launcher exits 0 (it once exited 143: the workers had no SIGTERM to report)."""
    run_dir = tmp_path / "run"
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT)], fault="0:6:sigterm-all@close")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert _last_line(err) == "meshlm launch: SIGTERM: every worker stopped cleanly; exiting 0", err[-3000:]
    assert SAVED not in out and read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == 6


@pytest.mark.slow  # an agent waiting in the rendezvous: ~10 s on 2 cores
def test_sigterm_before_any_worker_started_exits_0_with_nothing_to_save(data_cache: str, tmp_path: Path) -> None:
    """The agent of a 2-node job waits in the rendezvous for the other node, which never comes: SIGTERM there
    is a clean "nothing to save", not a failure (a scheduler would requeue a failed job over and over)."""
    port = free_port()
    launcher = ["launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", "alone", "-m", "meshlm.cli", "train"]  # fmt: skip
    proc = _start([*launcher, *_args(data_cache, tmp_path / "run")])

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    deadline = time.monotonic() + 120
    while not listening() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None and listening(), "the agent never opened its rendezvous"
    assert not _children(proc.pid)  # no worker yet
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert _last_line(err) == "meshlm launch: SIGTERM before any worker started: nothing to save; exiting 0", err


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_sigusr1_to_the_agent_and_workers_saves_once_and_exits_0(data_cache: str, tmp_path: Path) -> None:
    """`--signal=USR1@…` as Slurm delivers it: to the agent and every worker of the step at once."""
    run_dir = tmp_path / "run"
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=100_000)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    for pid in [proc.pid, *_children(proc.pid)]:
        os.kill(pid, signal.SIGUSR1)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count(SAVED) == 1, (out, err[-3000:])
    assert _last_line(err) == "meshlm launch: SIGUSR1: every worker stopped cleanly; exiting 0", err[-3000:]
    assert read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == int(out.split(SAVED)[1].split(",")[0])


@pytest.mark.slow  # a collective timeout and the agent's shutdown of a stopped process: ~60 s on 2 cores
def test_a_stalled_rank_is_named_in_the_failure_line(data_cache: str, tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP) mid-run; rank 0's collective times out and it says it lost a peer. The launcher's
    line names rank 1, the one that stopped responding, not rank 0."""
    run_dir = tmp_path / "run"
    args = _args(data_cache, run_dir, *LAYOUT, steps=100_000)
    args += ["--parallel.timeout_s", "10", "--fault.watchdog_s", "600"]  # the collective notices first
    proc = _start([LAUNCHER[0], "--shutdown-timeout", "5", *LAUNCHER[1:], *args])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    workers = sorted(_children(proc.pid))
    ranks = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in workers}
    stalled = next(pid for pid, env in ranks.items() if b"RANK=1" in env)
    os.kill(stalled, signal.SIGSTOP)
    _, err = _finish(proc)
    assert proc.returncode == 1, err[-3000:]
    line = _last_line(err)
    assert line.startswith("meshlm launch: rank 1 stopped responding or died (was killed by SIGKILL"), err[-3000:]
    assert "rank(s) 0 lost it: rank 0 lost a peer" in line, line
