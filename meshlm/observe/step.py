"""One training step's numbers on this rank: where the time went, throughput, MFU and memory.

    observer = StepObserver(flops_per_step, tokens_per_step, n_devices=world, device=device,
                            model=pm, optimizer=optimizer)
    observer.start_step()
    with observer.data_wait():
        batch = sampler.next_batch(...)
    ...  # forward, backward, optimizer: strategies time their own waits (meshlm.parallel.timers)
    metrics = observer.end_step()   # flat dict of floats, ready for MetricsLogger.log(**metrics)

Compute is what remains of the step: step time − exposed communication − bubble − data wait, so the parts
add up to the step time by construction; the spans themselves are measured directly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from meshlm.observe.memory import ActivationMeter, MemoryProbe, cuda_memory, process_memory
from meshlm.observe.peak import MEASURED_MATMUL, mfu_basis
from meshlm.observe.peak import peak_flops as device_peak_flops
from meshlm.parallel.timers import TIMERS, Timers


def mfu(flops: float, seconds: float, peak_flops: float, n_devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices that did the work."""
    return flops / seconds / (peak_flops * n_devices)


def breakdown(step_time_s: float, totals: dict[str, float]) -> dict[str, float]:
    """Split a step into compute, exposed communication (total and per kind), bubble and data wait.

    `totals` are blocked seconds by timer key. Compute is the remainder, clamped at zero (GPU event times and
    the host step clock can disagree by microseconds)."""
    comm = {key.removeprefix("comm/"): t for key, t in sorted(totals.items()) if key.startswith("comm/")}
    comm_s = sum(comm.values(), 0.0)
    bubble_s, data_wait_s = totals.get("bubble", 0.0), totals.get("data_wait", 0.0)
    return {
        "step_time_s": step_time_s,
        "compute_s": max(0.0, step_time_s - comm_s - bubble_s - data_wait_s),
        "comm_s": comm_s,
        **{f"comm_{kind}_s": t for kind, t in comm.items()},
        "bubble_s": bubble_s,
        "data_wait_s": data_wait_s,
    }


def agreed_peak_flops(device: torch.device) -> float:
    """The device peak averaged over ranks (a collective when the group has more than one rank): a measured
    peak differs from rank to rank, and every rank should report MFU against the same denominator."""
    peak = device_peak_flops(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        peak = total.item() / dist.get_world_size()
    return peak


class StepObserver:
    """Times steps and reads memory on one rank. Enables the process-wide timers for as long as it lives.

    `flops_per_step` and `tokens_per_step` are for the whole global batch (all ranks); `n_devices` is the
    world size, so MFU is per device. `peak_flops` per device defaults to the GPU datasheet table, else a
    matmul rate measured once per process and averaged over ranks: then construct the observer on all ranks
    together, right after a barrier, so ranks sharing a CPU measure their share of it. `mfu_basis` says which
    (`mfu_label` puts it next to the figure)."""

    def __init__(
        self,
        flops_per_step: float,
        tokens_per_step: int,
        n_devices: int = 1,
        device: torch.device | str = "cpu",
        peak_flops: float | None = None,
        model: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        activations: bool = False,
        timers: Timers = TIMERS,
    ) -> None:
        self.flops_per_step, self.tokens_per_step, self.n_devices = flops_per_step, tokens_per_step, n_devices
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peak_flops = peak_flops or agreed_peak_flops(self.device)
        name = torch.cuda.get_device_name(self.device) if self.cuda else ""
        self.mfu_basis = mfu_basis(self.device.type, name, given=bool(peak_flops))
        self.peak_raised = False  # a measured peak below an achieved rate is raised to it: MFU never > 100%
        self.windows = 0  # windows closed; the first (warm-up: first calls, allocator) never raises the peak
        self.timers = timers
        self.timers.enable(cuda=self.cuda)
        self.memory = MemoryProbe(model, optimizer) if model is not None else None
        self.activation_meter = ActivationMeter(model) if activations and model is not None else None
        self._measure_each_step = optimizer is None
        self._start = 0.0
        self._steps = 0  # steps in the window now open

    def data_wait(self) -> contextlib.AbstractContextManager:
        return self.timers.span("data_wait", device=False)

    def start_step(self) -> None:
        """Open a window at the first step after a closed one (a device sync on CUDA); later steps join it."""
        if self._steps:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.timers.take()  # drop what was timed between steps (evaluation, checkpoints)
        if self.activation_meter is not None:
            self.activation_meter.__enter__()
        self._start = self.timers.clock()

    def end_step(self, close: bool = True) -> dict[str, float] | None:
        """The step's metrics: the time breakdown, tokens/s, FLOP/s, MFU and memory (bytes). `close=False`
        leaves the window open and returns None: no host sync; the step that closes it reports the mean step
        of the window (times per step, peaks over it), so syncing every k steps costs one sync per k."""
        self._steps += 1
        if not close:
            return None
        n, self._steps = self._steps, 0
        if self.activation_meter is not None:
            self.activation_meter.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elapsed = (self.timers.clock() - self._start) / n
        metrics: dict[str, float] = breakdown(elapsed, {k: t / n for k, t in self.timers.take().items()})
        metrics["tokens_per_s"] = self.tokens_per_step / elapsed
        metrics["flops_per_s"] = self.flops_per_step / elapsed
        achieved = self.flops_per_step / elapsed / self.n_devices
        self.windows += 1
        if self.mfu_basis == MEASURED_MATMUL and achieved > self.peak_flops and self.windows > 1:
            # the matmul was measured low (a CPU shared with other work then): the best rate seen is the peak
            self.peak_flops, self.peak_raised = achieved, True
        metrics["mfu"] = mfu(self.flops_per_step, elapsed, self.peak_flops, self.n_devices)
        if self.memory is not None:
            metrics |= self.memory.measure() if self._measure_each_step else self.memory.last
        if self.activation_meter is not None:
            metrics["mem_activations_bytes"] = self.activation_meter.peak
        metrics |= cuda_memory(self.device) if self.cuda else process_memory()
        return metrics

    def mfu_label(self, value: float) -> str:
        """'MFU 86.5% of measured matmul': an MFU figure always says what it is a fraction of. The first window
        above a measured peak is one warm-up sample, not a rate to take as the peak: no figure then."""
        if value > 1 and self.mfu_basis == MEASURED_MATMUL and self.windows == 1:
            return f"MFU n/a (this first step ran above the {self.mfu_basis} rate)"
        raised = ", raised to the best achieved rate" if self.peak_raised else ""
        return f"MFU {value:.1%} of {self.mfu_basis}{raised}"

    def close(self) -> None:
        """Switch the process-wide timers off again (near-zero cost for code that runs without an observer)."""
        self.timers.disable()
