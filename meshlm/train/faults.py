"""Fault injection, for testing recovery end to end under torchrun (never set in production).

MESHLM_INJECT_FAULT="RANK:STEP:KIND" makes global rank RANK, at step STEP:
  kill       SIGKILL itself right after finishing the step (a crashed node),
  hang       stop making progress after the step (a stuck collective or deadlock),
  save-kill  SIGKILL itself halfway through writing that step's checkpoint (after its shard, before commit).
Only the first attempt of a torchrun job injects (TORCHELASTIC_RESTART_COUNT 0), so the restarted group
shows whether recovery works.
"""

from __future__ import annotations

import os
import signal
import time

KINDS = ("kill", "hang", "save-kill")


def _planned() -> tuple[int, int, str] | None:
    spec = os.environ.get("MESHLM_INJECT_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, step, kind = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"MESHLM_INJECT_FAULT kind {kind!r} is not one of {', '.join(KINDS)}")
    return int(rank), int(step), kind


def fault_point(point: str, rank: int, step: int) -> None:
    """Called at `point` ('step' after a step, 'save' mid-save); acts if a fault is planned for it."""
    planned = _planned()
    if planned is None or planned[:2] != (rank, step):
        return
    kind = planned[2]
    if (point, kind) in (("step", "kill"), ("save", "save-kill")):
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "step" and kind == "hang":
        while True:
            time.sleep(1)
