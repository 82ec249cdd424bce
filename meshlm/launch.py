"""`meshlm launch`: torchrun's own elastic agent (same arguments, same rendezvous), with the ending a scheduler
expects.

`meshlm launch --nproc-per-node 4 -m meshlm.cli train --config run.toml` runs exactly what
`torchrun --nproc-per-node 4 -m meshlm.cli train --config run.toml` runs (torch.distributed.run's parser,
rendezvous, restarts and worker supervision), and differs only in how it ends:

- SIGTERM to the agent (alone, or with the workers, or several times, as Slurm, Kubernetes and a node shutdown
  send it): the agent forwards one SIGTERM to its workers, they save once and exit 0, and the launcher exits 0
  with one line, where torchrun prints a SignalException traceback and exits 1 (so a scheduler would count a
  clean preemption as a failure). A further SIGTERM while the workers save is ignored instead of abandoning
  them; the agent still SIGKILLs them after its shutdown timeout (`--shutdown-timeout`, default 30 s).
  SIGUSR1, which many Slurm sites send as the warning (`--signal=USR1@…`), and SIGHUP (an ssh connection
  that drops, a closed terminal: only the agent gets it, torchrun's workers have their own sessions) are the
  same notice: one save, exit 0. A signal that comes after the workers finished (teardown), or before any
  worker started (from the first line of `meshlm launch`, before torch is imported), exits 0 too: the work
  is committed, or there was none to save.
- `MESHLM_STOP_EXIT=CODE` (the Kubernetes and SkyPilot files set 143, meshlm.plan.emit.STOP_EXIT): a run a
  signal stopped with steps left exits CODE instead of 0, so a scheduler that counts exit 0 as "succeeded"
  restarts it (docs/clusters.md, "Exit codes"); a run that trained to its last step still exits 0.
- `MESHLM_STOP_AFTER=SECONDS`: the launcher stops its own run that long after it started, as a SIGTERM
  would (one save, then MESHLM_STOP_EXIT's code): a self-timed stop before a wall limit that sends no
  signal, or one that comes too late for the save.
- Ctrl-C (SIGINT) to the agent (a terminal's reaches only the agent: torchrun starts its workers in their own
  sessions): the same one save, forwarded as SIGINT so each worker says so, then exit 130, the shell's code
  for an interrupt. A second Ctrl-C is forwarded too: the workers stop at once without saving (the newest
  committed checkpoint stays), and the launcher exits 130.
- a failed worker: one line naming the rank and its exit code (and its one-line error, where rank 0 did not
  print it), exit 1, instead of torchrun's ChildFailedError traceback and banner. Where the ranks that
  failed by themselves all lost a peer, the line names the rank they lost (stalled or killed) instead.
  torchrun's own log lines are shown from `LOGLEVEL=WARNING` (its variable) up; by default only critical ones.

The launcher ends with its exit code and no interpreter teardown (`exit_now`): a signal in the teardown of a
finished run (the default handlers are back by then) or a daemon thread torchrun leaves inside a store call (its
rendezvous keep-alive, after a signal) once turned a finished job into a killed or aborted one.

Workers tell the launcher how far they got through a file each, in a directory the launcher names in
MESHLM_LAUNCH_DIR, each with its process id: "started" (`worker_started`), then "stopped" once the run ended
with its work committed (`report_stopped`), or "finished" when it also trained to its last step. After a
signal, a worker that started and never stopped cleanly (killed, still saving at the SIGKILL, failed) makes
the launcher exit 143, the code of a process ended by SIGTERM. A launcher a save signal stopped cleanly before
its run finished also writes the file MESHLM_STOPPED_FILE names, if any: the sbatch script requeues on it
(Slurm signals the step's tasks, not the batch shell). A signal after every worker finished writes no such
file: requeueing would only start a job with nothing left to train.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn

from meshlm.train.signals import INTERRUPTED_EXIT, release_hung_up_terminal

LAUNCH_DIR = "MESHLM_LAUNCH_DIR"
STOPPED_FILE = "MESHLM_STOPPED_FILE"
STOP_EXIT_VAR = "MESHLM_STOP_EXIT"
STOP_AFTER_VAR = "MESHLM_STOP_AFTER"
HOST_NODE_VAR = "MESHLM_RDZV_HOST_NODE"  # under Slurm: the node (SLURMD_NODENAME) that hosts the rendezvous store
STARTED, STOPPED, FINISHED = "started", "stopped", "finished"
SIGTERM_EXIT = 128 + signal.SIGTERM
BAD_INPUT_EXIT = 2
SAVE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # each asks for one save
TIME_UP = "MESHLM_STOP_AFTER"  # the name the lines give a self-timed stop (SIGALRM)
LOST_PEER = "lost a peer"  # a worker's error line when a collective failed because another rank is gone


_early: list[signal.Signals] = []


def _note_early(signum: int, frame: FrameType | None) -> None:
    _early.append(signal.Signals(signum))


def catch_early() -> None:
    """From the first line of `meshlm launch` (the CLI calls this before it imports anything else): a save
    signal only counts until the agent's own handler is in place, instead of killing the launcher while it
    imports torch; `main` then ends with "nothing to save"."""
    for sig in SAVE_SIGNALS:
        signal.signal(sig, _note_early)


def _env_seconds(name: str, top: float) -> float | None:
    """A whole number of seconds in 0..top from the environment variable `name`; None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) > top:
        raise ValueError(f"{name}={text!r}: expected a whole number from 0 to {top:g}")
    return float(text)


def _status_file() -> Path | None:
    directory = os.environ.get(LAUNCH_DIR)
    return Path(directory) / f"rank{os.environ.get('LOCAL_RANK', '0')}" if directory else None


def _write_status(word: str) -> None:
    if (path := _status_file()) is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{word} {os.getpid()}")
        os.replace(tmp, path)


def _read_status(directory: Path, nproc: int) -> dict[int, tuple[str, int]]:
    """Each local rank's word and process id, for the workers that started."""
    found = {}
    for rank in range(nproc):
        if (path := directory / f"rank{rank}").is_file():
            word, pid = path.read_text().split()
            found[rank] = (word, int(pid))
    return found


def worker_started() -> None:
    """A worker under `meshlm launch` starts: it has work that a signal must see saved (a restart overwrites
    the last attempt's word)."""
    _write_status(STARTED)


def report_stopped(finished: bool) -> None:
    """A worker under `meshlm launch` ended with its work committed: saved after a signal, stopped before its
    first step with nothing to save, or `finished` (trained to its last step: nothing left to requeue)."""
    _write_status(FINISHED if finished else STOPPED)


def report_error(message: str) -> None:
    """A worker's one-line error, where torchrun's agent reads a failed worker's reason (its error file)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
        except OSError:  # the line was printed already; the file only repeats it to the agent
            return


class _FirstSignalOnly:
    """The agent's SIGTERM / SIGUSR1 / SIGINT handler: the first raises torchrun's SignalException, so its agent
    forwards SIGTERM (SIGINT for a Ctrl-C) to the workers and waits for them; later ones are the same notice
    again and must not abandon that wait, except a second Ctrl-C, which goes on to the workers: they stop at
    once."""

    def __init__(self, directory: Path, nproc: int) -> None:
        self.directory, self.nproc = directory, nproc
        self.received: signal.Signals | None = None
        self.interrupts = 0
        self.stopped_at_once = False  # a second Ctrl-C reached workers still running

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        release_hung_up_terminal()  # a SIGHUP's terminal is gone: the lines below must not fail on it
        self.interrupts += signum == signal.SIGINT
        if self.received is None:
            self.received = signal.Signals(signum)
            forward = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
            raise SignalException(f"Process {os.getpid()} got signal: {self.received}", sigval=forward)
        if signum == signal.SIGINT and self.interrupts == 2:
            for word, pid in _read_status(self.directory, self.nproc).values():
                if word == STARTED:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
                        self.stopped_at_once = True


def _stop_outcome(
    directory: Path, nproc: int, received: signal.Signals, at_once: bool = False, stop_exit: int = 0
) -> int:
    """After a save signal: `stop_exit` (MESHLM_STOP_EXIT, default 0) when every worker that started ended with
    its work committed and steps are left (130 after a Ctrl-C), 0 once they trained to the last step, else 143.
    `at_once`: a second Ctrl-C stopped the workers without their save."""
    words = {rank: word for rank, (word, _) in _read_status(directory, nproc).items()}
    unfinished = [r for r, word in words.items() if word not in (STOPPED, FINISHED)]
    name = TIME_UP if received == signal.SIGALRM else received.name
    if at_once:
        print("meshlm launch: SIGINT again: workers stopped at once, nothing more saved; the next start resumes "
              "from the newest valid checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        return INTERRUPTED_EXIT
    if unfinished:
        print(f"meshlm launch: {name}: local rank(s) {', '.join(map(str, unfinished))} did not stop cleanly "
              "(killed, failed or still saving at the shutdown timeout); the next start resumes from the newest "
              "valid checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        return SIGTERM_EXIT
    finished = bool(words) and set(words.values()) == {FINISHED}
    code = INTERRUPTED_EXIT if received == signal.SIGINT else 0 if finished else stop_exit
    if finished:
        print(f"meshlm launch: {name} after the run finished: nothing to save; exiting {code}", file=sys.stderr,
              flush=True)  # fmt: skip
    elif words:
        print(f"meshlm launch: {name}: every worker stopped cleanly; exiting {code}", file=sys.stderr, flush=True)
    else:
        print(f"meshlm launch: {name} before any worker started: nothing to save; exiting {code}", file=sys.stderr,
              flush=True)  # fmt: skip
    if (stopped := os.environ.get(STOPPED_FILE)) and not finished and code != INTERRUPTED_EXIT:  # a Ctrl-C: no requeue
        Path(stopped).write_text(f"{name}\n")
    return code


def _how(failure: object) -> str:
    code = failure.exitcode  # type: ignore[attr-defined]
    return f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"  # type: ignore[attr-defined]


def _failure_line(error: BaseException) -> str:
    failures = error.failures  # type: ignore[attr-defined]
    # the first that failed by itself: the others were then stopped by the agent's SIGTERM
    own = sorted((f.timestamp, r) for r, f in failures.items() if f.exitcode > 0)
    rank, failure = (own[0][1], failures[own[0][1]]) if own else error.get_first_failure()  # type: ignore[attr-defined]
    lost = [r for _, r in own if LOST_PEER in str(failures[r].message)]
    culprits = sorted(set(failures) - set(lost))
    if lost and len(lost) == len(own) and culprits:  # they all lost a peer: it is the one that did not say so
        rank, failure = culprits[0], failures[culprits[0]]
        ranks = ", ".join(map(str, lost))
        return (f"meshlm launch: rank {rank} stopped responding or died ({_how(failure)} at shutdown); "
                f"rank(s) {ranks} lost it: {failures[lost[0]].message}")  # fmt: skip
    how = _how(failure)
    others = f" ({len(failures)} ranks failed)" if len(failures) > 1 else ""
    # a rank 0 that failed by itself printed its own line; another rank's error is repeated only otherwise
    said = 0 in failures and failures[0].exitcode > 0
    reason = failure.message if isinstance(failure.message, str) and failure.exitcode > 0 and not said else ""
    return f"meshlm launch: rank {rank} {how}{others}" + (f": {reason}" if reason else "")


def main(argv: list[str]) -> NoReturn:
    """Run torchrun with `argv` (its own arguments) and end this process with the exit code a scheduler should
    see (`exit_now`)."""
    exit_now(_run(argv))


def exit_now(code: int) -> NoReturn:
    """End the launcher with `code`, its output flushed, without the interpreter's teardown, where a finished
    run could still end as a failure (tests/integration/test_launch_exit.py shows both): a signal there (the
    scheduler's teardown SIGTERM) meets the default handler the interpreter has put back and kills the launcher;
    a daemon thread inside a store call (C++, the GIL released) when the teardown begins is ended as it takes
    the GIL back (`pthread_exit` through C++ frames), which aborts the process ("terminate called without an
    active exception"; Slurm marked such a job FAILED). torchrun's rendezvous keep-alive is such a thread, a
    heartbeat every 5 s while its handler lives (`launch_agent` does not shut the rendezvous down after a
    signal). Nothing is left to tear down here: the workers have exited, the launcher's directory is removed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            stream.flush()
    os._exit(code)


def _run(argv: list[str]) -> int:
    """`main`'s work: the exit code a scheduler should see."""
    if signal.getsignal(signal.SIGTERM) is not _note_early:
        catch_early()
    try:
        stop_exit = int(_env_seconds(STOP_EXIT_VAR, 255) or 0)
        stop_after = _env_seconds(STOP_AFTER_VAR, 365 * 86400)
    except ValueError as e:
        print(f"meshlm launch: {e}", file=sys.stderr, flush=True)
        return BAD_INPUT_EXIT
    quiet = "LOGLEVEL" not in os.environ  # torchrun's agent logs at LOGLEVEL (its own variable); ours: critical only
    if quiet:
        os.environ["LOGLEVEL"] = "CRITICAL"
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if quiet:
        del os.environ["LOGLEVEL"]  # the workers' own logging is theirs
        for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    args = torchrun.parse_args(argv)
    head, here = os.environ.get(HOST_NODE_VAR), os.environ.get("SLURMD_NODENAME")
    if head and here and "is_host" not in args.rdzv_conf:  # an address endpoint: torchrun's guess can miss
        is_host = f"is_host={str(head == here).lower()}"
        args.rdzv_conf = f"{args.rdzv_conf},{is_host}" if args.rdzv_conf else is_host
    nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    # torchrun's agent installs its own handler for these (--signals-to-handle) at every worker start; the save
    # signals stay ours
    ours = {s.name for s in SAVE_SIGNALS}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in ours)
    with tempfile.TemporaryDirectory(prefix="meshlm-launch-") as directory:
        handler = _FirstSignalOnly(Path(directory), nproc)
        if _early:  # a save signal while torch was imported: no worker has started
            return _stop_outcome(Path(directory), nproc, _early[0], stop_exit=stop_exit)
        os.environ[LAUNCH_DIR] = directory
        for sig in (*SAVE_SIGNALS, signal.SIGALRM):
            signal.signal(sig, handler)
        if stop_after is not None:  # SIGALRM, as a SIGTERM: torchrun's agent waits in its monitor loop meanwhile
            signal.setitimer(signal.ITIMER_REAL, max(stop_after, 0.001))
        try:
            torchrun.run(args)
        except SignalException as e:
            if handler.received is not None:
                return _stop_outcome(Path(directory), nproc, handler.received, handler.stopped_at_once, stop_exit)
            print(f"meshlm launch: {e.sigval.name}: workers stopped", file=sys.stderr, flush=True)
            return 128 + e.sigval
        except ChildFailedError as e:
            print(_failure_line(e), file=sys.stderr, flush=True)
            return 1
        except Exception as e:  # rendezvous and agent errors: torchrun's own words, in one line
            if handler.received is not None:  # a save signal in the rendezvous: torchrun's error is its consequence
                return _stop_outcome(Path(directory), nproc, handler.received, handler.stopped_at_once, stop_exit)
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"meshlm launch: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
            return 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            handler.received = handler.received or signal.SIGTERM  # a signal after the agent returned: nothing to stop
    return 0
