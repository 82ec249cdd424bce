"""Guards that turn silent failures into loud, recoverable ones.

- `Watchdog`: a rank that finishes no step within the timeout (stuck collective, deadlock) dumps every
  thread's Python stack to the run directory and exits non-zero, so torchrun's agent restarts the group.
- `Preemption`: SIGTERM (a spot notice, however many times it arrives) is counted; the loop finishes its step,
  all ranks agree, save once, exit 0 (the handler itself: meshlm.train.signals).
- `StepGuard`: a non-finite gradient norm or a loss spike vetoes the update (the trainer then skips it or
  rolls back, by policy) or stops the run; always logged.
- `check_replicas_in_sync`: data-parallel replicas compare parameter checksums; a mismatch names rank and tensor.
"""

from __future__ import annotations

import faulthandler
import math
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.parallel.engine import ParallelModel
from meshlm.train import signals


class TrainingFault(RuntimeError):
    """A failure the run must not continue past (non-finite loss under policy 'stop', replica desync)."""


class Watchdog:
    """Re-armed after every step; if it ever fires, faulthandler writes all stacks and calls _exit(1)."""

    def __init__(self, run_dir: Path, rank: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._file = None
        if timeout_s > 0:
            path = Path(run_dir) / "stacks" / f"rank{rank}.txt"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("w")
            except OSError as e:  # the first write into log.run_dir: a file there, a read-only mount
                from meshlm.checkpoint.store import StorageError, run_dir_problem  # (imports DCP: only here)

                raise StorageError(run_dir_problem(run_dir, e)) from None

    def arm(self, timeout_s: float | None = None) -> None:
        if self._file is not None:
            faulthandler.dump_traceback_later(timeout_s or self.timeout_s, exit=True, file=self._file)

    def disarm(self) -> None:
        """For work of unbounded length that has its own timeout (tokenizing a corpus behind a barrier)."""
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None


class Preemption:
    """SIGTERM for a training loop: `requested()` is True on every rank as soon as any rank received one.

    Schedulers signal every process at once and launchers forward their own SIGTERM, so a rank may get several:
    each is the same notice and the loop saves once (meshlm.train.signals). The handler is the process's (the
    CLI installs it before start-up) or, in a user's program, installed here and given back by `close()`."""

    def __init__(self) -> None:
        self._owns_handler = signals.install()
        signals.start_training()

    def requested(self, device: torch.device) -> bool:
        flag = torch.tensor([float(signals.received() > 0)], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._owns_handler:
            signals.finish_run(release=True)


class StepGuard:
    """Decides whether an optimizer step may be applied. Every rank sees the same loss and global norm, so
    every rank takes the same decision without extra communication."""

    def __init__(self, policy: str, spike_factor: float, window: int = 20) -> None:
        self.policy = policy
        self.spike_factor = spike_factor
        self._recent: deque[float] = deque(maxlen=window)
        self.last_reason = ""

    def allow(self, loss: float, grad_norm: float) -> bool:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.last_reason = f"non-finite loss {loss} or gradient norm {grad_norm}"
        elif self.spike_factor and len(self._recent) >= 5 and loss > self.spike_factor * self._mean():
            self.last_reason = f"loss spike {loss:.4f} > {self.spike_factor} × recent mean {self._mean():.4f}"
        else:
            self._recent.append(loss)
            self.last_reason = ""
            return True
        if self.policy == "stop":
            raise TrainingFault(f"stopping: {self.last_reason} (fault.nonfinite = 'stop')")
        return False

    def _mean(self) -> float:
        return sum(self._recent) / len(self._recent)


@torch.no_grad()
def check_replicas_in_sync(model: ParallelModel) -> None:
    """Compare a checksum of every local parameter across the dp group; raise naming rank and tensor."""
    mesh = model.mesh
    dp = mesh.size("dp")
    if dp == 1:
        return
    names, sums = [], []
    for name, p in model.named_parameters():
        if p.numel():
            names.append(name)
            sums.append(torch.stack([p.double().sum(), p.double().pow(2).sum()]))
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local, group=mesh.group("dp"))
    for dp_rank in range(1, dp):
        mismatch = (gathered[dp_rank] != gathered[0]).any(dim=1).nonzero()
        if len(mismatch):
            name = names[int(mismatch[0])]
            global_rank = dist.get_global_rank(mesh.group("dp"), dp_rank)
            raise TrainingFault(
                f"replica desync: parameter {name} on dp rank {dp_rank} (global rank {global_rank}) "
                f"differs from dp rank 0"
            )
