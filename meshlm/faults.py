"""Fault injection, for testing recovery end to end under torchrun (never set in production).

MESHLM_INJECT_FAULT="RANK:STEP:KIND" makes global rank RANK, at step STEP:
  kill       SIGKILL itself right after finishing the step (a crashed node),
  abort      SIGABRT itself right after finishing the step (a C++ std::terminate or abort in an extension),
  hang       stop making progress after the step (a stuck collective or deadlock),
  save-kill  SIGKILL itself halfway through writing that step's checkpoint (after its shard, before commit),
  sigterm@POINT        SIGTERM itself, once, at POINT: `step` (after the step), `save` (its shard of that step's
                       checkpoint written, the save still in flight), `tokenize` (STEP 0: reading the corpus to
                       tokenize it) or `close` (teardown, after the loop: STEP is the last step),
  sigterm-all@POINT    the same to the launcher's agent (its parent, under torchrun or `meshlm launch`) and
                       every worker of that agent, itself included, as Slurm and a node shutdown signal all the
                       job's processes together (the agent first, so the workers get its forwarded one too),
  sigint@POINT, sigint-all@POINT   the same with SIGINT (Ctrl-C); `sigint2@POINT` sends it twice (Ctrl-C
                       pressed again while the run saves).
Only the first attempt of a torchrun job injects (TORCHELASTIC_RESTART_COUNT 0), so the restarted group
shows whether recovery works.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

KINDS = ("kill", "abort", "hang", "save-kill", "sigterm", "sigterm-all", "sigint", "sigint-all", "sigint2")
POINTS = ("step", "save", "tokenize", "close")
_fired: set[str] = set()


def _planned() -> tuple[int, int, str] | None:
    spec = os.environ.get("MESHLM_INJECT_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, step, kind = spec.split(":")
    if kind.partition("@")[0] not in KINDS or kind.partition("@")[2] not in ("", *POINTS):
        raise ValueError(f"MESHLM_INJECT_FAULT kind {kind!r} is not one of {', '.join(KINDS)} (sigterm@{POINTS})")
    return int(rank), int(step), kind


def _agent_and_workers() -> list[int]:
    """The agent (the parent, when this process is a torchrun worker), then its children, this one last."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return [os.getpid()]
    agent = os.getppid()
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == agent and int(stat.parent.name) != os.getpid():
            workers.append(int(stat.parent.name))
    return [agent, *workers, os.getpid()]


def fault_point(point: str, rank: int, step: int) -> None:
    """Called at `point` ('step' after a step, 'save' mid-save); acts if a fault is planned for it."""
    planned = _planned()
    if planned is None or planned[:2] != (rank, step):
        return
    kind, _, at = planned[2].partition("@")
    if kind.startswith(("sigterm", "sigint")) and (at or "step") == point and kind not in _fired:
        _fired.add(kind)
        signum = signal.SIGTERM if kind.startswith("sigterm") else signal.SIGINT
        targets = _agent_and_workers() if kind.endswith("-all") else [os.getpid()]
        for pid in targets * (2 if kind == "sigint2" else 1):
            os.kill(pid, signum)
    if (point, kind) in (("step", "kill"), ("save", "save-kill")):
        os.kill(os.getpid(), signal.SIGKILL)
    if (point, kind) == ("step", "abort"):
        os.abort()
    if point == "step" and kind == "hang":
        while True:
            time.sleep(1)
