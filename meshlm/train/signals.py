"""SIGTERM as schedulers deliver it (to every process at once, often more than once), and Ctrl-C (SIGINT).

Slurm, Kubernetes and a node shutdown signal the launcher's agent and every worker together; the agent then
forwards its own SIGTERM, so a worker gets two or more. Each is the same notice. The handler is installed
first thing (before the long start-up work: torch's import, tokenization, the model build) and stays
installed until the process exits, so no SIGTERM ever kills a meshlm process silently:

- during start-up (before the first step) the first SIGTERM raises `Preempted`, which unwinds start-up at
  once; there is nothing to save (`meshlm train` says so in one line and exits 0);
- once training runs, every SIGTERM only counts: the loop sees `received()` at its next sync step, all ranks
  agree, save once and exit 0 (`meshlm.train.guards.Preemption`);
- during teardown, after the last save, it only counts too.

SIGUSR1, the warning many Slurm sites configure (`--signal=USR1@…`, delivered to every task of the step), is
the same notice as SIGTERM everywhere here, and so is SIGHUP (an ssh connection that drops, a terminal window
closed): one save, one line ("SIGHUP: saved step N"), exit 0. A hang-up also leaves stdout and stderr on a
terminal that is gone, where every write fails (EIO) and would end the run in a traceback before its save:
the handler points such descriptors at /dev/null first (`release_hung_up_terminal`), for SIGTERM too (the
workers of `meshlm launch` get the agent's SIGTERM, not the hang-up, on the same dead terminal).
SIGQUIT (Ctrl-\\) is left at its default, a core dump without a save: it is the terminal's way out when a
stop that saves is not wanted or is itself stuck (a save hanging on a dead filesystem), and the newest
committed checkpoint stays the resume point. Only SIGKILL (the scheduler's hard kill after the notice) and
SIGQUIT stop the process otherwise. This module imports nothing heavy, so the CLI installs the handler before
importing torch.

SIGINT (Ctrl-C, or torchrun's agent forwarding its own Ctrl-C to its workers) is the same notice: one save, one
line, and `meshlm train` exits 130 (128 + SIGINT, the shell's code for an interrupted command) instead of 0. A
background save in flight completes first. A second SIGINT while training is a person who wants out now: it
raises KeyboardInterrupt at once (no save; the newest committed checkpoint stays the resume point).
"""

from __future__ import annotations

import errno
import os
import signal
import termios
import threading
from types import FrameType

PREEMPTED_BEFORE_START = "preempted before the first step; nothing to save"
INTERRUPTED_BEFORE_START = "interrupted (SIGINT) before the first step; nothing to save"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # SIGUSR1 and SIGHUP are SIGTERMs here
INTERRUPTED_EXIT = 128 + signal.SIGINT  # what `meshlm train` exits with after a Ctrl-C (and its save)


class Preempted(BaseException):
    """SIGTERM or SIGINT before the first training step: start-up stops, nothing to save.

    A BaseException (as KeyboardInterrupt), so that `except Exception` blocks in start-up code let it pass."""

    def __str__(self) -> str:
        return before_start_line()


class _State:
    installed = False  # our handler is the process's SIGTERM handler
    owner = ""  # "process": installed for the process's lifetime (the CLI); "run": by one fit() call
    previous: dict[int, object] = {}  # noqa: RUF012 (one instance)
    count = 0  # SIGTERMs and SIGINTs received since installation (or since the run began)
    interrupts = 0  # of which SIGINTs
    first = 0  # the first signal received (0: none)
    training = False  # a training loop is running: SIGTERM only counts
    deferred = False  # the CLI's own imports run: SIGTERM only counts until `raise_from_here`
    raised = False  # Preempted was raised once (or the run is over); later SIGTERMs only count
    stopped_start_up = False  # a SIGTERM raised Preempted into start-up


_state = _State()


def release_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that hung up (every write to one fails
    with EIO), so the lines a stop prints cannot end the run before its save; a file, a pipe or a live
    terminal stays as it is."""
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as e:
            if e.args[0] != errno.EIO:
                continue  # not a terminal (ENOTTY): a file or a pipe
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except OSError:  # a closed descriptor
            continue


def _handle(signum: int, frame: FrameType | None) -> None:
    release_hung_up_terminal()
    _state.count += 1
    _state.first = _state.first or signum
    if signum == signal.SIGINT:
        _state.interrupts += 1
        if _state.training and _state.interrupts > 1:  # a second Ctrl-C: stop now, without the save
            raise KeyboardInterrupt
    if not (_state.training or _state.raised or _state.deferred):
        _state.raised = _state.stopped_start_up = True
        raise Preempted


def install(for_process: bool = False, deferred: bool = False) -> bool:
    """Install the SIGTERM and SIGINT handler unless it is installed; return whether this call installed it.

    `for_process`: keep it until the process exits (the CLI). Otherwise it belongs to one run (`fit` called
    from a user's program) and `finish_run(release=True)` puts the previous handler back. A run starting in a
    process whose handler is already installed (the CLI's) keeps it and what it counted. `deferred`: a SIGTERM
    only counts until `raise_from_here` (raised into the middle of an import, it can break the extension
    being loaded before the CLI can say anything)."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        return False  # Python delivers signals to the main thread only: a run in another thread cannot install
    _state.previous = {signum: signal.signal(signum, _handle) for signum in SIGNALS}
    _state.installed, _state.owner = True, "process" if for_process else "run"
    _state.count, _state.training, _state.raised, _state.stopped_start_up = 0, False, False, False
    _state.interrupts = _state.first = 0
    _state.deferred = deferred
    return True


def raise_from_here() -> None:
    """End a deferred start: a SIGTERM received so far raises `Preempted` now, later ones when they come."""
    _state.deferred = False
    if _state.count and not (_state.training or _state.raised):
        _state.raised = _state.stopped_start_up = True
        raise Preempted


def stopped_start_up() -> bool:
    """Whether a SIGTERM stopped start-up. Whatever exception start-up then ends with is its consequence:
    `Preempted` itself, or another that replaced it on the way out (a library that catches it and raises
    its own, a peer's closed connection when every rank was signalled and one left first)."""
    return _state.stopped_start_up


def start_training() -> None:
    """Start-up is over: from here on a SIGTERM is a notice the loop answers with one save."""
    _state.training = True


def received() -> int:
    """How many stop signals (SIGTERM, SIGUSR1, SIGINT, SIGHUP) this process has received (0: none)."""
    return _state.count


def interrupted() -> bool:
    """Whether the first stop signal was SIGINT (Ctrl-C): the run exits 130 after its save, not 0."""
    return _state.first == signal.SIGINT


def signal_name() -> str:
    """The first stop signal's name, for the line that says what the run did about it (SIGUSR1, the scheduler's
    warning, is named SIGTERM)."""
    return {signal.SIGINT: "SIGINT", signal.SIGHUP: "SIGHUP"}.get(_state.first, "SIGTERM")


def before_start_line() -> str:
    """The one line a stop before the first step ends with."""
    return INTERRUPTED_BEFORE_START if interrupted() else PREEMPTED_BEFORE_START


def ignore_from_here() -> None:
    """The CLI's run is over and its exit code decided: a process-lifetime handler becomes SIG_IGN (for SIGTERM
    and SIGINT), which
    Python keeps through interpreter shutdown (it puts the default, deadly, handler back in place of a
    Python one), so a late SIGTERM cannot turn the exit code into 143."""
    if _state.installed and _state.owner == "process":
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def finish_run(release: bool) -> None:
    """The run is over (returned or failed): a SIGTERM from now on only counts, never raises into teardown.
    `release`: the caller installed the handler for this run, so the handler that was there before comes
    back; a handler installed for the process stays until it exits."""
    _state.training = False
    _state.raised = True
    if release and _state.installed and _state.owner == "run":
        for signum, previous in _state.previous.items():  # None: a handler not set from Python, so the default's
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)  # type: ignore[arg-type]
        _state.installed = False
