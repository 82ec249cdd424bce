"""Memory by category: parameters, gradients, optimizer state and saved activations as tensor bytes (exact on
any device), plus the allocator's view on GPU and the process RSS.

Tensor bytes are counted per storage as the union of the byte ranges the tensors cover, so views of one flat
buffer (ZeRO buffers, tied weights, a master shard inside its buffer) are counted once and exactly.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import defaultdict
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors occupy, each storage byte counted once however many tensors view it. A view reaching
    past its storage's bytes counts only what the storage holds: a ZeRO-3 parameter whose gathered weights are
    freed (its storage resized to 0 bytes, at address 0 like every other freed one) counts nothing."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t in tensors:
        storage = t.untyped_storage()
        size = t.element_size()
        extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
        start = t.storage_offset() * size
        end = min(start + extent * size, storage.nbytes())
        if t.numel() and end > start:
            spans[storage.data_ptr()].append((start, end))
    total = 0
    for ranges in spans.values():
        covered = 0  # end of the union so far
        for lo, hi in sorted(ranges):
            if hi > covered:
                total += hi - max(lo, covered)
                covered = hi
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW: exp_avg, exp_avg_sq), not the scalar step counts."""
    return [v for state in optimizer.state.values() for k, v in state.items() if k != "step" and torch.is_tensor(v)]


class MemoryProbe:
    """Parameter, gradient and optimizer-state bytes of one rank, measured right after each optimizer step.

    That moment is the high-water mark of the three: gradients still exist (zero_grad comes later) and the
    optimizer state is allocated. `model` is anything with `named_parameters()` (nn.Module, ParallelModel);
    the optimizer's own parameters (ZeRO's fp32 master shards) count as parameters too."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.last: dict[str, int] = {}
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.measure())

    def measure(self) -> dict[str, int]:
        params = [p for _, p in self.model.named_parameters()]
        state: list[torch.Tensor] = []
        if self.optimizer is not None:
            params += [p for group in self.optimizer.param_groups for p in group["params"]]
            state = optimizer_state_tensors(self.optimizer)
        dp = getattr(self.model, "dp", None)  # ParallelModel's data-parallel owner of the gradient buffers
        self.last = {
            "mem_params_bytes": tensor_bytes(params),
            # Under data parallel / ZeRO the gradients live in its buffers, which are not always any parameter's
            # .grad (fp32 accumulation under bf16 working weights: meshlm.parallel.dp.zero): it counts them.
            "mem_grads_bytes": dp.memory_report()["grads"]
            if dp is not None
            else tensor_bytes(p.grad for p in params if p.grad is not None),
            "mem_optimizer_bytes": tensor_bytes(state),
        }
        return self.last


class _Saved:
    """A tensor autograd saved for backward; releases its bytes from the meter when autograd drops it."""

    __slots__ = ("generation", "key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int) -> None:
        self.tensor, self.meter, self.key, self.generation = tensor, meter, key, meter.generation

    def __del__(self) -> None:
        self.meter._release(self.key, self.generation)


class ActivationMeter:
    """Peak bytes of tensors saved for backward while the meter is open (the activation memory).

    Uses `torch.autograd.graph.saved_tensors_hooks`: each saved tensor's storage is counted once while any
    saved reference to it lives; storages of parameters are not activations and are skipped. Costs a Python
    call per saved tensor, so it is opt-in. Inside activation-checkpointed regions torch's own hooks take
    over and only the checkpoint inputs are seen, which is what such a region keeps."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.peak = 0
        self.generation = 0  # one per opening: a graph that outlives its step cannot release the next one's bytes
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._current = 0
        self._excluded: set[int] = set()
        self._hooks: Any = None

    def __enter__(self) -> ActivationMeter:
        self._excluded = {p.untyped_storage()._cdata for _, p in self.model.named_parameters()}
        self.peak, self._current, self._live = 0, 0, {}
        self.generation += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)

    def _pack(self, tensor: torch.Tensor) -> Any:
        # A storage by its identity (the key torch.serialization shares storages by), not its address: ZeRO-3
        # frees a parameter's storage between uses and re-allocates it elsewhere, the same storage.
        key = tensor.untyped_storage()._cdata
        if key in self._excluded:
            return tensor
        entry = self._live.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self._current += entry[1]
            self.peak = max(self.peak, self._current)
        entry[0] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int, generation: int) -> None:
        entry = self._live.get(key)
        if entry is None or generation != self.generation:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._current -= entry[1]
            del self._live[key]


def process_memory() -> dict[str, int]:
    """Resident set size of this process now and at its peak (Linux /proc; peak from getrusage)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    out = {"mem_rss_peak_bytes": peak}
    try:
        with open("/proc/self/statm") as f:
            out["mem_rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return out


def cuda_memory(device: torch.device) -> dict[str, int]:
    """The caching allocator's figures since the last `torch.cuda.reset_peak_memory_stats`."""
    return {
        "mem_allocated_bytes": torch.cuda.memory_allocated(device),
        "mem_peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "mem_reserved_bytes": torch.cuda.memory_reserved(device),
    }
