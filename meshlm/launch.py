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
- a failed worker: one line naming the rank and its exit code (and its one-line error, where rank 0 did not
  print it), exit 1, instead of torchrun's ChildFailedError traceback and banner. torchrun's own log lines are
  shown from `LOGLEVEL=WARNING` (its variable) up; by default only critical ones.

Workers tell the launcher that they stopped cleanly through a file each, in a directory the launcher names
in MESHLM_LAUNCH_DIR (`report_preempted`); a worker that never wrote one (killed, still saving at the
SIGKILL, failed) makes the preempted launcher exit 143, the code of a process ended by SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

LAUNCH_DIR = "MESHLM_LAUNCH_DIR"
PREEMPTED = "preempted"
SIGTERM_EXIT = 128 + signal.SIGTERM


def _status_file() -> Path | None:
    directory = os.environ.get(LAUNCH_DIR)
    return Path(directory) / f"rank{os.environ.get('LOCAL_RANK', '0')}" if directory else None


def worker_started() -> None:
    """A worker under `meshlm launch` starts: no clean stop reported yet (a restarted attempt clears the last)."""
    if (path := _status_file()) is not None:
        path.unlink(missing_ok=True)


def report_preempted() -> None:
    """A worker under `meshlm launch` stopped cleanly after SIGTERM (saved, or nothing to save yet)."""
    if (path := _status_file()) is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(PREEMPTED)
        os.replace(tmp, path)


def report_error(message: str) -> None:
    """A worker's one-line error, where torchrun's agent reads a failed worker's reason (its error file)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
        except OSError:  # the line was printed already; the file only repeats it to the agent
            return


class _FirstSigtermOnly:
    """The agent's SIGTERM handler: the first raises torchrun's SignalException, so its agent forwards SIGTERM to
    the workers and waits for them; later ones are the same notice again and must not abandon that wait."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.received:
            return
        self.received = True
        raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}", sigval=signal.SIGTERM)


def _preemption_outcome(directory: Path, nproc: int) -> int:
    missing = [r for r in range(nproc) if not (directory / f"rank{r}").is_file()]
    if not missing:
        print("meshlm launch: SIGTERM: every worker stopped cleanly; exiting 0", file=sys.stderr, flush=True)
        return 0
    ranks = ", ".join(map(str, missing))
    print(
        f"meshlm launch: SIGTERM: local rank(s) {ranks} did not stop cleanly (killed, failed or still saving at "
        f"the shutdown timeout); the next start resumes from the newest valid checkpoint",
        file=sys.stderr,
        flush=True,
    )
    return SIGTERM_EXIT


def _failure_line(error: BaseException) -> str:
    failures = error.failures  # type: ignore[attr-defined]
    # the first that failed by itself: the others were then stopped by the agent's SIGTERM
    own = sorted((f.timestamp, r) for r, f in failures.items() if f.exitcode > 0)
    rank, failure = (own[0][1], failures[own[0][1]]) if own else error.get_first_failure()  # type: ignore[attr-defined]
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    others = f" ({len(failures)} ranks failed)" if len(failures) > 1 else ""
    # a rank 0 that failed by itself printed its own line; another rank's error is repeated only otherwise
    said = 0 in failures and failures[0].exitcode > 0
    reason = failure.message if isinstance(failure.message, str) and failure.exitcode > 0 and not said else ""
    return f"meshlm launch: rank {rank} {how}{others}" + (f": {reason}" if reason else "")


def main(argv: list[str]) -> int:
    """Run torchrun with `argv` (its own arguments); return the exit code a scheduler should see."""
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
    nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    # torchrun's agent installs its own handler for these (--signals-to-handle) at every worker start; SIGTERM
    # stays ours
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() != "SIGTERM")
    handler = _FirstSigtermOnly()
    with tempfile.TemporaryDirectory(prefix="meshlm-launch-") as directory:
        os.environ[LAUNCH_DIR] = directory
        signal.signal(signal.SIGTERM, handler)
        try:
            torchrun.run(args)
        except SignalException as e:
            if handler.received:
                return _preemption_outcome(Path(directory), nproc)
            print(f"meshlm launch: {e.sigval.name}: workers stopped", file=sys.stderr, flush=True)
            return 128 + e.sigval
        except ChildFailedError as e:
            print(_failure_line(e), file=sys.stderr, flush=True)
            return 1
        except Exception as e:  # rendezvous and agent errors: torchrun's own words, in one line
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"meshlm launch: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
            return 1
        finally:
            handler.received = True  # a SIGTERM after the agent returned: nothing left to stop
    return 0
