"""Every stop signal a person or a scheduler sends (meshlm/train/signals.py, meshlm/launch.py,
docs/fault-tolerance.md "Signals and what you see"): SIGHUP (an ssh connection that drops, a terminal closed)
saves once like SIGTERM, also when the terminal it came from is gone (every write to it fails with EIO);
a SIGTERM to `meshlm launch` while it imports torch is "nothing to save", exit 0, not a death by the signal;
MESHLM_STOP_AFTER stops a run by itself, with MESHLM_STOP_EXIT's code. SIGQUIT keeps its default (a core
dump, no save; the docs say why).

Mutations each test was seen to fail under: SIGHUP left out of `signals.SIGNALS` / `launch.SAVE_SIGNALS` (the
run dies by SIGHUP, nothing saved); `release_hung_up_terminal` not called from the handlers (the step lines
written to the dead terminal end the run in an EIO traceback); `catch_early` not called (the handler comes
only after torch is loaded); the SIGALRM timer not set (the run trains on).
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
from test_preemption_signals import LAUNCHER, LAYOUT, _args, _finish, _newest_intact, _start, _wait_for_train_record

from meshlm.plan.emit import STOP_EXIT

TOTAL = 100_000  # steps: a run the signal always stops mid-way


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_sighup_is_a_save_signal_named_in_its_line() -> None:
    """The handler counts a SIGHUP as a stop notice (no exception while training) and names it; SIGQUIT stays
    at its default."""
    done = _python("""
        import os, signal
        from meshlm.train import signals
        signals.install()
        signals.start_training()
        os.kill(os.getpid(), signal.SIGHUP)
        print(signals.received(), signals.signal_name(), signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL)
    """)
    assert done.returncode == 0 and done.stdout == "1 SIGHUP True\n", done.stderr


def test_a_hung_up_terminal_is_released_so_writes_do_not_fail() -> None:
    """stdout on a terminal whose other end closed: a write fails with EIO until `release_hung_up_terminal`
    points it at /dev/null; a pipe (stderr here) is left as it is."""
    done = _python("""
        import os, pty, sys
        from meshlm.train.signals import release_hung_up_terminal
        master, slave = pty.openpty()
        saved = os.dup(1)
        os.dup2(slave, 1)
        os.close(master)  # the terminal's other end is gone
        try:
            os.write(1, b"x")
            before = "wrote"
        except OSError as e:
            before = e.errno
        release_hung_up_terminal()
        os.write(1, b"x")  # raises if still the dead terminal
        os.dup2(saved, 1)
        print(before)
        sys.stderr.write("still a pipe")
    """)
    assert done.returncode == 0 and done.stdout == "5\n" and done.stderr == "still a pipe", done.stderr


def _under_a_terminal(command: list[str]) -> tuple[subprocess.Popen, int]:
    """`meshlm COMMAND` as a terminal's session leader (its controlling terminal a new pty), as an ssh login's
    command runs; returns the process and the terminal's master end."""
    master, slave = pty.openpty()

    def session() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *command], stdin=slave, stdout=slave, stderr=slave,
                            env=env, preexec_fn=session)  # fmt: skip
    os.close(slave)
    return proc, master


def _hang_up_after_a_step(proc: subprocess.Popen, master: int, metrics: Path) -> str:
    """Read the terminal (a full pty blocks its writers) until a training step is logged, then close it: the
    kernel sends SIGHUP to the session's foreground process group, and every later write to it fails."""
    out, deadline = b"", time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if select.select([master], [], [], 0.1)[0]:
            out += os.read(master, 1 << 16)
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            break
    assert proc.poll() is None, out.decode(errors="replace")[-3000:]
    os.close(master)
    return out.decode(errors="replace")


@pytest.mark.slow  # a `meshlm train` process: ~10 s on 2 busy cores
def test_train_saves_once_when_its_terminal_hangs_up(data_cache: str, tmp_path: Path) -> None:
    """An ssh connection that drops: SIGHUP, and a terminal that is gone. The run saves where it was and exits
    0 (it once died by SIGHUP without saving); the resume point is that step, intact."""
    run_dir = tmp_path / "run"
    proc, master = _under_a_terminal(["train", *_args(data_cache, run_dir, steps=TOTAL)])
    _hang_up_after_a_step(proc, master, run_dir / "metrics.jsonl")
    assert proc.wait(timeout=300) == 0
    assert 0 < _newest_intact(run_dir) < TOTAL


@pytest.mark.slow  # a `meshlm train` process: ~10 s on 2 busy cores
def test_sighup_with_output_to_a_file_saves_once_in_one_line(data_cache: str, tmp_path: Path) -> None:
    """`meshlm train > log` in an ssh session without nohup: the hang-up comes, the log is fine: one save, one
    line naming SIGHUP, exit 0."""
    run_dir = tmp_path / "run"
    proc = _start(["train", *_args(data_cache, run_dir, steps=TOTAL)])
    _wait_for_train_record(proc, run_dir / "metrics.jsonl")
    proc.send_signal(signal.SIGHUP)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("SIGHUP: saved step") == 1 and "Traceback" not in err, (out[-3000:], err[-3000:])
    assert _newest_intact(run_dir) == int(out.split("SIGHUP: saved step")[1].split(",")[0])


@pytest.mark.slow  # a torchrun agent and two workers: ~25 s on 2 cores
def test_launch_saves_once_when_its_terminal_hangs_up(data_cache: str, tmp_path: Path) -> None:
    """Only the agent gets the hang-up (torchrun starts its workers in their own sessions); it forwards one
    SIGTERM; the workers, whose output goes to the same dead terminal, save once; exit 0."""
    run_dir = tmp_path / "run"
    proc, master = _under_a_terminal([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=TOTAL)])
    _hang_up_after_a_step(proc, master, run_dir / "metrics.jsonl")
    assert proc.wait(timeout=300) == 0
    assert 0 < _newest_intact(run_dir) < TOTAL


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (/proc/PID/status, SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_launch_sigterm_while_torch_is_imported_exits_0_with_nothing_to_save(tmp_path: Path) -> None:
    """A SIGTERM as soon as `meshlm launch` catches it, before torch is even loaded (it once killed the launcher
    by the signal: exit -15, no line): "nothing to save", exit 0."""
    command = [*LAUNCHER, "--model.preset", "test", "--log.run_dir", str(tmp_path / "run")]
    proc = _start(command)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # the handler came before torch
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert err.strip().splitlines() == ["meshlm launch: SIGTERM before any worker started: nothing to save; exiting 0"]


@pytest.mark.slow  # a torchrun agent and two workers for MESHLM_STOP_AFTER seconds: ~45 s
def test_launch_stops_itself_after_meshlm_stop_after_with_the_stop_code(data_cache: str, tmp_path: Path) -> None:
    """A self-timed stop before a wall limit: the launcher stops its own run as a SIGTERM would (one save) and
    exits MESHLM_STOP_EXIT's code, naming MESHLM_STOP_AFTER in its line. 40 s: past torch's import and the
    first steps on a loaded machine (the test then waits for a step before the timer can have fired)."""
    run_dir = tmp_path / "run"
    env = {"MESHLM_STOP_AFTER": "40", "MESHLM_STOP_EXIT": str(STOP_EXIT)}
    os.environ.update(env)
    try:
        proc = _start([*LAUNCHER, *_args(data_cache, run_dir, *LAYOUT, steps=TOTAL)])
    finally:
        for key in env:
            del os.environ[key]
    _wait_for_train_record(proc, run_dir / "metrics.jsonl", timeout=39)
    out, err = _finish(proc)
    assert proc.returncode == STOP_EXIT, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"meshlm launch: MESHLM_STOP_AFTER: every worker stopped cleanly; exiting {STOP_EXIT}"
    )
    assert out.count("SIGTERM: saved step") == 1
    assert _newest_intact(run_dir) == int(out.split("SIGTERM: saved step")[1].split(",")[0])


@pytest.mark.parametrize(("name", "value"), [("MESHLM_STOP_EXIT", "abc"), ("MESHLM_STOP_EXIT", "256"),
                                             ("MESHLM_STOP_AFTER", "-5")])  # fmt: skip
def test_a_bad_stop_variable_is_one_line_and_exit_2(name: str, value: str) -> None:
    env = {**os.environ, name: value}
    done = subprocess.run([sys.executable, "-m", "meshlm.cli", *LAUNCHER, "--model.preset", "test"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"meshlm launch: {name}={value!r}: expected a whole number from 0 to"), done.stderr
