"""SIGTERM as schedulers deliver it: to every process at once, often more than once.

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
the same notice as SIGTERM everywhere here. Only SIGKILL (the scheduler's hard kill after the notice) stops
the process otherwise. This module imports
nothing heavy, so the CLI installs the handler before importing torch.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

PREEMPTED_BEFORE_START = "preempted before the first step; nothing to save"


class Preempted(BaseException):
    """SIGTERM before the first training step: start-up stops, nothing to save.

    A BaseException (as KeyboardInterrupt), so that `except Exception` blocks in start-up code let it pass."""

    def __str__(self) -> str:
        return PREEMPTED_BEFORE_START


NOTICES = (signal.SIGTERM, signal.SIGUSR1)  # each is a SIGTERM here


class _State:
    installed = False  # our handler is the process's SIGTERM handler
    owner = ""  # "process": installed for the process's lifetime (the CLI); "run": by one fit() call
    previous: object = None
    previous_usr1: object = None
    count = 0  # SIGTERMs received since installation (or since the run began)
    training = False  # a training loop is running: SIGTERM only counts
    deferred = False  # the CLI's own imports run: SIGTERM only counts until `raise_from_here`
    raised = False  # Preempted was raised once (or the run is over); later SIGTERMs only count
    stopped_start_up = False  # a SIGTERM raised Preempted into start-up


_state = _State()


def _handle(signum: int, frame: FrameType | None) -> None:
    _state.count += 1
    if not (_state.training or _state.raised or _state.deferred):
        _state.raised = _state.stopped_start_up = True
        raise Preempted


def install(for_process: bool = False, deferred: bool = False) -> bool:
    """Install the SIGTERM handler unless it is installed; return whether this call installed it.

    `for_process`: keep it until the process exits (the CLI). Otherwise it belongs to one run (`fit` called
    from a user's program) and `finish_run(release=True)` puts the previous handler back. A run starting in a
    process whose handler is already installed (the CLI's) keeps it and what it counted. `deferred`: a SIGTERM
    only counts until `raise_from_here` (raised into the middle of an import, it can break the extension
    being loaded before the CLI can say anything)."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        return False  # Python delivers signals to the main thread only: a run in another thread cannot install
    _state.previous = signal.signal(signal.SIGTERM, _handle)
    _state.previous_usr1 = signal.signal(signal.SIGUSR1, _handle)
    _state.installed, _state.owner = True, "process" if for_process else "run"
    _state.count, _state.training, _state.raised, _state.stopped_start_up = 0, False, False, False
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
    """How many SIGTERMs this process has received (0: none)."""
    return _state.count


def ignore_from_here() -> None:
    """The CLI's run is over and its exit code decided: a process-lifetime handler becomes SIG_IGN, which
    Python keeps through interpreter shutdown (it puts the default, deadly, handler back in place of a
    Python one), so a late SIGTERM cannot turn the exit code into 143."""
    if _state.installed and _state.owner == "process":
        for notice in NOTICES:
            signal.signal(notice, signal.SIG_IGN)


def finish_run(release: bool) -> None:
    """The run is over (returned or failed): a SIGTERM from now on only counts, never raises into teardown.
    `release`: the caller installed the handler for this run, so the handler that was there before comes
    back; a handler installed for the process stays until it exits."""
    _state.training = False
    _state.raised = True
    if release and _state.installed and _state.owner == "run":
        for notice, previous in ((signal.SIGTERM, _state.previous), (signal.SIGUSR1, _state.previous_usr1)):
            # None: a handler not set from Python, so the default's
            signal.signal(notice, signal.SIG_DFL if previous is None else previous)  # type: ignore[arg-type]
        _state.installed = False
