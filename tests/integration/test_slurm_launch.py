"""`meshlm launch`'s exit code as a scheduler reads it (meshlm/launch.py): 0 whenever the run ended with its
work committed, including a SIGTERM that arrives in teardown (after the last checkpoint) or before any worker
started; SIGUSR1 (a Slurm site's `--signal=USR1@…`, delivered to every task of the step) is the same notice as
SIGTERM; Ctrl-C (SIGINT) saves the same way and exits 130; a stalled rank is named in the failure line. The
requeue file (MESHLM_STOPPED_FILE) is left only when a save signal stopped a run before its end. Signals are
timed by events (a fault point, a record in metrics.jsonl, the rendezvous port accepting), never by sleeps,
with generous bounds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from distributed import free_port
from test_preemption_signals import LAUNCHER, LAYOUT, SAVED, _args, _children, _finish, _start, _wait_for_train_record

from meshlm import launch
from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state

INTERRUPTED = "SIGINT: saved step"


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_sigterm_in_teardown_after_the_last_checkpoint_exits_0(
    data_cache: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to the agent and both workers once the loop is over (its last checkpoint committed): the run's
    work is done, so the launcher exits 0 (it once exited 143: the workers had no SIGTERM to report), and
    leaves no requeue file (it once did: the sbatch script requeued a finished job for one more allocation)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(launch.STOPPED_FILE, str(tmp_path / "stopped"))
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT)], fault="0:6:sigterm-all@close")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert _last_line(err) == "meshlm launch: SIGTERM after the run finished: nothing to save; exiting 0", err
    assert SAVED not in out and read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == 6
    assert not (tmp_path / "stopped").exists()


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
def test_sigusr1_to_the_agent_and_workers_saves_once_and_exits_0(
    data_cache: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--signal=USR1@…` as Slurm delivers it: to the agent and every worker of the step at once. The run
    stopped before its end, so the launcher leaves the requeue file."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(launch.STOPPED_FILE, str(tmp_path / "stopped"))
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=100_000)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    for pid in [proc.pid, *_children(proc.pid)]:
        os.kill(pid, signal.SIGUSR1)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count(SAVED) == 1, (out, err[-3000:])
    assert _last_line(err) == "meshlm launch: SIGUSR1: every worker stopped cleanly; exiting 0", err[-3000:]
    assert read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == int(out.split(SAVED)[1].split(",")[0])
    assert (tmp_path / "stopped").read_text() == "SIGUSR1\n"


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_ctrl_c_to_the_launcher_saves_once_and_exits_130(
    data_cache: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminal's Ctrl-C reaches the agent only (torchrun's workers run in their own sessions): it is routed
    to the workers as a save, as SIGTERM is; they save once and say so, and the launcher exits 130 in one line
    and asks for no requeue (a person stopped it)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(launch.STOPPED_FILE, str(tmp_path / "stopped"))
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=100_000)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert proc.returncode == 130, err[-3000:]
    assert out.count(INTERRUPTED) == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err, (out, err)
    assert _last_line(err) == "meshlm launch: SIGINT: every worker stopped cleanly; exiting 130", err[-3000:]
    assert read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == int(out.split(INTERRUPTED)[1].split(",")[0])
    assert not (tmp_path / "stopped").exists()


def _status(directory: Path, rank: int, word: str, pid: int) -> None:
    (directory / f"rank{rank}").write_text(f"{word} {pid}")


def test_a_second_ctrl_c_goes_on_to_the_workers_still_running(tmp_path: Path) -> None:
    """The launcher's handler: the first Ctrl-C becomes torchrun's SignalException with SIGINT to forward (one
    save); a second is sent on to the workers that have not stopped (real processes here; a worker stops at once
    on its second SIGINT, tests/integration/test_preemption_signals.py), not to one that already stopped; the
    launcher then says so in one line and exits 130."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    running, stopped = (subprocess.Popen(["sleep", "300"]) for _ in range(2))
    try:
        _status(tmp_path, 0, launch.STARTED, running.pid)
        _status(tmp_path, 1, launch.STOPPED, stopped.pid)
        handler = launch._FirstSignalOnly(tmp_path, 2)
        with pytest.raises(SignalException) as info:
            handler(signal.SIGINT, None)
        assert info.value.sigval == signal.SIGINT
        handler(signal.SIGTERM, None)  # any other notice is the same notice again: ignored
        assert running.poll() is None and not handler.stopped_at_once
        handler(signal.SIGINT, None)
        assert running.wait(timeout=60) == -signal.SIGINT and handler.stopped_at_once
        assert stopped.poll() is None
    finally:
        for proc in (running, stopped):
            proc.kill()
            proc.wait()
    assert launch._stop_outcome(tmp_path, 2, signal.SIGINT, at_once=True) == 130


@pytest.mark.parametrize(
    ("words", "received", "code", "line", "requeue"),
    [
        ((launch.STOPPED, launch.STOPPED), signal.SIGTERM, 0, "SIGTERM: every worker stopped cleanly; exiting 0", True),
        ((launch.FINISHED, launch.FINISHED), signal.SIGTERM, 0, "SIGTERM after the run finished: nothing to save; "
         "exiting 0", False),
        ((launch.STOPPED, launch.STOPPED), signal.SIGINT, 130, "SIGINT: every worker stopped cleanly; exiting 130",
         False),
        ((launch.STOPPED, launch.STARTED), signal.SIGTERM, 143, "SIGTERM: local rank(s) 1 did not stop cleanly", False),
    ],
    ids=["saved", "finished", "ctrl-c", "unclean"],
)  # fmt: skip
def test_the_requeue_file_is_left_only_when_a_signal_stopped_the_run_before_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], words: tuple[str, str],
    received: signal.Signals, code: int, line: str, requeue: bool,
) -> None:  # fmt: skip
    """What the launcher reads from its workers' status files after a signal: the exit code, its line, and
    whether the sbatch script's requeue file is written (never for a finished run or a Ctrl-C)."""
    stopped_file = tmp_path / "requeue"
    monkeypatch.setenv(launch.STOPPED_FILE, str(stopped_file))
    (directory := tmp_path / "launch").mkdir()
    for rank, word in enumerate(words):
        _status(directory, rank, word, 1)
    assert launch._stop_outcome(directory, 2, received) == code
    assert capsys.readouterr().err.startswith(f"meshlm launch: {line}")
    assert stopped_file.exists() == requeue


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
