"""SIGTERM the way clusters deliver it (docs/fault-tolerance.md, "Signals and what you see"): any number of them,
to the launcher's agent and every worker together, to the workers only, during start-up, during a background
save and during teardown. Each ends with exit 0, one promised line, and the newest checkpoint intact.

Faults are timed by events, never by sleeps: `MESHLM_INJECT_FAULT=RANK:STEP:sigterm@POINT` (meshlm/faults.py)
signals at a named point of the run, and external signals wait for a record in metrics.jsonl. Every wait has a
generous deadline, so the tests pass on a busy machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from run_args import small_run_args

from meshlm.checkpoint import list_checkpoints, verify_checkpoint
from meshlm.checkpoint.store import read_trainer_state
from meshlm.train.signals import PREEMPTED_BEFORE_START

SAVED = "SIGTERM: saved step"
LAUNCH_CLEAN = "meshlm launch: SIGTERM: every worker stopped cleanly; exiting 0"


def _args(data_cache: str, run_dir: Path, *extra: str, steps: int = 6) -> list[str]:
    return [*small_run_args(data_cache, run_dir), "--train.steps", str(steps), "--checkpoint.every", "2",
            "--train.eval_every", "0", "--log.every", "1", "--fault.watchdog_s", "120",
            "--parallel.timeout_s", "120", *extra]  # fmt: skip


def _start(command: list[str], fault: str = "") -> subprocess.Popen:
    env = {**os.environ, "MESHLM_INJECT_FAULT": fault, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "meshlm.cli", *command], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None


def _wait_for_train_record(proc: subprocess.Popen, metrics: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no training step logged (exit code {proc.poll()})")


def _newest_intact(run_dir: Path) -> int:
    """The newest checkpoint verifies against its manifest; its step."""
    newest = list_checkpoints(run_dir)[-1]
    verify_checkpoint(newest)
    return read_trainer_state(newest)["step"]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return found


def test_sigterm_raises_into_start_up_once_and_only_counts_once_training_runs() -> None:
    """The handler itself: during start-up the first SIGTERM raises Preempted and later ones only count; once
    training runs every SIGTERM only counts; the handler stays installed after the run (teardown)."""
    code = textwrap.dedent("""
        import os, signal
        from meshlm.train import signals
        signals.install(for_process=True)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000): pass
            raise SystemExit("no Preempted")
        except signals.Preempted:
            os.kill(os.getpid(), signal.SIGTERM)  # during the unwinding: counted, not raised again
            for _ in range(1000): pass
        print("start-up", signals.received(), signals.stopped_start_up())
        signals.start_training()
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000): pass
        print("training", signals.received())
        signals.finish_run(release=False)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000): pass
        print("teardown", signals.received(), signal.getsignal(signal.SIGTERM) is signals._handle)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["start-up 2 True", "training 5", "teardown 6 True"], out.stdout


def _preempted_at_start(out: str) -> bool:
    """The promised line, once and last; before it only the operator's "data: ..." line that rank 0 prints as
    tokenizing starts and the tokenizer's progress lines (docs/observability.md)."""
    lines = out.splitlines()
    before = all(line.startswith(("data: ", "tokenizing ")) for line in lines[:-1])
    return lines[-1:] == [PREEMPTED_BEFORE_START] and before


@pytest.mark.slow  # a `meshlm train` process tokenizing a fresh corpus: ~10 s on 2 busy cores
def test_sigterm_during_tokenization_exits_zero_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(["train", *_args(str(tmp_path / "fresh-cache"), run_dir)], fault="0:0:sigterm@tokenize")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert _preempted_at_start(out) and "Traceback" not in err, (out, err[-3000:])
    assert not list_checkpoints(run_dir)


@pytest.mark.slow  # a `meshlm train` process: ~10 s on 2 busy cores
def test_two_sigterms_in_a_row_save_once_and_exit_zero(data_cache: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(["train", *_args(data_cache, run_dir, steps=100_000)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # the scheduler's and the agent's, back to back
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count(SAVED) == 1 and "Traceback" not in err, (out, err[-3000:])
    step = int(out.split(SAVED)[1].split(",")[0])
    assert _newest_intact(run_dir) == step


@pytest.mark.slow  # a `meshlm train` process each: ~10 s on 2 busy cores
@pytest.mark.parametrize("fault", ["0:2:sigterm@save", "0:6:sigterm@close"], ids=["async-save", "teardown"])
def test_sigterm_during_a_save_or_teardown_keeps_the_newest_checkpoint(
    data_cache: str, tmp_path: Path, fault: str
) -> None:
    """During step 2's background save (its shard written, not committed): the loop notices at its next step
    boundary, saves once after step 2's save has committed, exits 0. During teardown, after the last step's
    save: nothing more to do, exit 0, no traceback."""
    run_dir = tmp_path / "run"
    args = _args(data_cache, run_dir, "--checkpoint.async_save", "true", "--checkpoint.keep", "10")
    proc = _start(["train", *args], fault=fault)
    out, err = _finish(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    if fault.endswith("close"):
        assert SAVED not in out and _newest_intact(run_dir) == 6, out
        return
    assert out.count(SAVED) == 1, out
    step = int(out.split(SAVED)[1].split(",")[0])
    assert step > 2 and _newest_intact(run_dir) == step
    assert "step_00000002" in [p.name for p in list_checkpoints(run_dir)]  # the save in flight committed
    verify_checkpoint(list_checkpoints(run_dir)[0])


# ---- Ctrl-C (SIGINT): the same one save, exit 130 ----------------------------------------------------------

INTERRUPTED = "SIGINT: saved step"


@pytest.mark.slow  # a `meshlm train` process each: ~10 s on 2 busy cores
@pytest.mark.parametrize("fault", ["0:3:sigint", "0:2:sigint@save"], ids=["between-steps", "async-save"])
def test_ctrl_c_saves_once_and_exits_130(data_cache: str, tmp_path: Path, fault: str) -> None:
    """Ctrl-C is a stop like SIGTERM: the loop saves once (after a background save in flight has committed)
    and says so in one line; the exit code is the shell's for an interrupt, 130."""
    run_dir = tmp_path / "run"
    args = _args(data_cache, run_dir, "--checkpoint.async_save", "true", "--checkpoint.keep", "10")
    proc = _start(["train", *args], fault=fault)
    out, err = _finish(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert out.count(INTERRUPTED) == 1, out
    step = int(out.split(INTERRUPTED)[1].split(",")[0])
    assert 2 < step < 6 and _newest_intact(run_dir) == step
    assert "step_00000002" in [p.name for p in list_checkpoints(run_dir)]  # the save in flight committed


@pytest.mark.slow  # a `meshlm train` process: ~10 s on 2 busy cores
def test_a_second_ctrl_c_stops_at_once_in_one_line(data_cache: str, tmp_path: Path) -> None:
    """Ctrl-C twice: the second stops the run where it is, in one line, without a save; the newest
    committed checkpoint stays intact."""
    run_dir = tmp_path / "run"
    proc = _start(["train", *_args(data_cache, run_dir, "--checkpoint.async_save", "false")], fault="0:3:sigint2")
    out, err = _finish(proc)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["meshlm: interrupted (SIGINT): stopped at once, nothing more saved"], err
    assert INTERRUPTED not in out and _newest_intact(run_dir) == 2


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_ctrl_c_under_torchrun_saves_once(data_cache: str, tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches torchrun's agent only (its workers run in their own sessions); the agent
    forwards SIGINT once to every worker: they agree, save once, and exit 130. (torchrun itself then reports
    its own SignalException and exits 1: the agent is torchrun's code, not meshlm's.)"""
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "meshlm.cli", "train", *_args(data_cache, run_dir, *LAYOUT, steps=100_000)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(torchrun, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert out.count(INTERRUPTED) == 1 and "KeyboardInterrupt" not in err, (out, err[-3000:])
    assert _newest_intact(run_dir) == int(out.split(INTERRUPTED)[1].split(",")[0])


# ---- under `meshlm launch` (torchrun's agent): the patterns schedulers deliver --------------------------------

LAUNCHER = ["launch", "--standalone", "--nproc-per-node", "2", "-m", "meshlm.cli", "train"]
LAYOUT = ("--parallel.layout", "dp=2")


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_launch_sigterm_to_agent_and_workers_together_saves_once_and_exits_zero(
    data_cache: str, tmp_path: Path
) -> None:
    """Slurm's pattern: every process at once, the agent forwarding its own on top (the workers get two)."""
    run_dir = tmp_path / "run"
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT)], fault="0:3:sigterm-all")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count(SAVED) == 1 and f"{SAVED} 3, exiting" in out, out
    assert err.strip().splitlines()[-1] == LAUNCH_CLEAN and "Traceback" not in err, err[-3000:]
    assert _newest_intact(run_dir) == 3


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
@pytest.mark.parametrize("target", ["workers", "agent-twice"])
def test_launch_sigterm_to_workers_only_or_the_agent_twice_exits_zero(
    data_cache: str, tmp_path: Path, target: str
) -> None:
    """Workers only (the agent is not told): they agree, save once, exit 0, and so does the agent. The agent
    twice in a row: the second must not abandon the workers' save."""
    run_dir = tmp_path / "run"
    proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=100_000)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    if target == "workers":
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count(SAVED) == 1 and "Traceback" not in err, (out, err[-3000:])
    if target != "workers":
        assert err.strip().splitlines()[-1] == LAUNCH_CLEAN, err[-3000:]
    assert _newest_intact(run_dir) == int(out.split(SAVED)[1].split(",")[0])


@pytest.mark.slow  # a torchrun agent and two workers: ~20 s on 2 cores
def test_launch_sigterm_during_tokenization_exits_zero_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = _args(str(tmp_path / "fresh-cache"), run_dir, *LAYOUT)
    proc = _start([*LAUNCHER, *args], fault="0:0:sigterm-all@tokenize")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert _preempted_at_start(out), (out, err[-3000:])  # rank 0 only
    assert err.strip().splitlines()[-1] == LAUNCH_CLEAN and "Traceback" not in err, err[-3000:]
    assert not list_checkpoints(run_dir)


@pytest.mark.slow  # a torchrun agent and two workers: ~15 s on 2 cores
def test_launch_failure_is_one_line_per_process_not_a_banner(data_cache: str, tmp_path: Path) -> None:
    """Both ranks refuse the same config: rank 0 says why, the launcher which rank failed; no traceback, no
    ChildFailedError banner, exit 1."""
    args = _args(data_cache, tmp_path / "run", *LAYOUT, "--train.global_batch", "7")
    proc = _start([*LAUNCHER, *args])
    _, err = _finish(proc)
    assert proc.returncode == 1
    assert err.strip().splitlines() == [
        "meshlm: train.global_batch (7) is not divisible by dp=2",
        err.strip().splitlines()[-1],
    ], err
    assert err.strip().splitlines()[-1].startswith("meshlm launch: rank "), err
    assert "exited with code 2" in err and "ChildFailedError" not in err and "Traceback" not in err
