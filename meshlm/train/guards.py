"""Guards that turn silent failures into loud, recoverable ones.

- `Watchdog`: a rank that finishes no step within the timeout (stuck collective, deadlock) dumps every
  thread's Python stack to the run directory and exits non-zero, so torchrun's agent restarts the group.
- `Preemption`: SIGTERM (a spot notice, however many times it arrives) is counted; the loop finishes its step,
  all ranks agree, save once, exit 0 (the handler itself: meshlm.train.signals).
- `StepGuard`: a non-finite gradient norm or a loss spike vetoes the update (the trainer then skips it or
  rolls back, by policy) or stops the run; always logged. `DeviceStepGuard` takes the same decision on the
  device, without a host sync.
- `check_replicas_in_sync`: data-parallel replicas compare parameter checksums; a mismatch names rank and tensor.
"""

from __future__ import annotations

import faulthandler
import math
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.errors import RunStopped
from meshlm.parallel.engine import ParallelModel
from meshlm.train import signals


class TrainingFault(RunStopped):
    """A failure the run must not continue past (non-finite loss under policy 'stop', too many skipped or
    rolled-back updates, replica desync)."""


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
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        spike = finite and self.spike_factor and len(self._recent) >= 5 and loss > self.spike_factor * self._mean()
        return self.decided(loss, grad_norm, finite and not spike)

    def decided(self, loss: float, grad_norm: float, applied: bool) -> bool:
        """Record a decision taken here or on the device (DeviceStepGuard): the loss joins the recent window if
        the update was applied, else the reason is kept (and under policy 'stop' the run stops)."""
        if applied:
            self._recent.append(loss)
            self.last_reason = ""
            return True
        if not math.isfinite(loss):
            self.last_reason = f"non-finite loss {loss} (gradient norm {grad_norm})"
        elif not math.isfinite(grad_norm):
            self.last_reason = f"non-finite gradient norm {grad_norm} (loss {loss:.4f})"
        else:
            self.last_reason = f"loss spike {loss:.4f} > {self.spike_factor} × recent mean {self._mean():.4f}"
        if self.policy == "stop":
            raise TrainingFault(f"stopping: {self.last_reason} (fault.nonfinite = 'stop')")
        return False

    def _mean(self) -> float:
        return sum(self._recent) / len(self._recent)

    def state_dict(self) -> dict:
        """The window of recent applied losses (a healing replica group takes its peer's: meshlm.train.replicas)."""
        return {"recent": list(self._recent), "last_reason": self.last_reason}

    def load_state_dict(self, state: dict) -> None:
        self._recent.clear()
        self._recent.extend(state["recent"])
        self.last_reason = state["last_reason"]


class DeviceStepGuard:
    """StepGuard's decision taken on the device, so a step can be vetoed with no host sync (train.sync_every >
    1): `allow(loss, grad_norm)` returns a device bool and keeps the window of recent applied losses on the
    device too, as float64 like the host's. The host later reads the decision and records it with
    `StepGuard.decided`; the two agree except for a loss within float64 rounding of the spike threshold."""

    def __init__(self, spike_factor: float, device: torch.device, window: int = 20) -> None:
        self.spike_factor = spike_factor
        self.recent = torch.zeros(window, dtype=torch.float64, device=device)
        self.slots = torch.arange(window, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # applied losses so far

    def allow(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().double()
        ok = loss.isfinite() & grad_norm.detach().isfinite()
        if self.spike_factor:
            held = self.count.clamp(max=len(self.recent))
            mean = self.recent.sum() / held.clamp(min=1)
            ok &= (held < 5) | (loss <= self.spike_factor * mean)
        slot = self.count % len(self.recent)
        self.recent = torch.where((self.slots == slot) & ok, loss, self.recent)
        self.count = self.count + ok.long()
        return ok


# Elements per slice of a checksum: its int64 temporaries stay ~100 MB whatever the tensor's size.
CHECKSUM_SLICE = 1 << 22
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> its bits' dtype


@torch.no_grad()
def bit_checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of `t`'s bits, read in place (no float64 copy): Σ (i+1)·bits_i over its elements in
    order, mod 2^64. Replicas that differ in one element, by one ulp or more, differ in it: the change δ·(i+1)
    is non-zero and below 2^63 in size for fp32/bf16 (|δ| < 2^32, i < 2^31), so it cannot vanish mod 2^64 — a
    float sum would round a one-ulp change of a small element away. Moving an element also changes it."""
    bits = t.detach().reshape(-1).view(_BITS[t.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), CHECKSUM_SLICE):
        part = bits[start : start + CHECKSUM_SLICE].long()
        total += (part * torch.arange(start + 1, start + 1 + part.numel(), device=t.device)).sum()
    return total


@torch.no_grad()
def check_replicas_in_sync(model: ParallelModel) -> None:
    """Compare a checksum of the bits of every local parameter (bit_checksum) across the dp group; raise naming
    rank and tensor. The parameters are read where they live (views of data parallel's flat buffers, in their
    own dtype); reading one waits for a ZeRO-1/2 weight gather still in flight (meshlm.parallel.dp.gather)."""
    mesh = model.mesh
    dp = mesh.size("dp")
    if dp == 1:
        return
    names, sums = [], []
    for name, p in model.named_parameters():
        if p.numel():
            names.append(name)
            sums.append(bit_checksum(p))
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local, group=mesh.group("dp"))
    for dp_rank in range(1, dp):
        mismatch = (gathered[dp_rank] != gathered[0]).nonzero()
        if len(mismatch):
            name = names[int(mismatch[0])]
            global_rank = dist.get_global_rank(mesh.group("dp"), dp_rank)
            raise TrainingFault(
                f"replica desync: parameter {name} on dp rank {dp_rank} (global rank {global_rank}) "
                f"differs from dp rank 0"
            )
