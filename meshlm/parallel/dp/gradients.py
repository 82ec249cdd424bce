"""The gradients and optimizer tensors of a parallel model, and who owns them.

One object owns what the optimizer steps and the gradients it reads (ParallelModel asks it and nothing else):
data parallel / ZeRO's `DataParallel` (meshlm.parallel.dp.data_parallel) wherever replicas reduce gradients or
ZeRO shards state, else `LocalGradients`, the parameters as this rank holds them, whose gradients need no
reduction. Both answer the same calls: the optimizer's tensors and groups, the squared gradient norm this
rank counts, scaling and zeroing the gradients, what follows the optimizer step, and the pieces of state for
checkpoints (`ShardedTensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ShardedTensor:
    """Elements [offset, offset + local.numel()) of the flattened tensor `name` of shape `global_shape`."""

    name: str
    global_shape: torch.Size
    offset: int
    local: torch.Tensor


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's per-element state (AdamW: exp_avg, exp_avg_sq; SGD: momentum_buffer): the tensors
    shaped like their parameter, which are sharded with it. Scalars (step counts) are not."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape and v.ndim)
    return []


def unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once, padding included)."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


# The CPU kernel of `_foreach_norm` accumulates a tensor's squares in one fp32 running sum, whose relative error
# grows with its length: 2e-5 on a 233k-element flat gradient buffer, 2e-8 on 4096-element pieces (measured).
CPU_NORM_PIECE = 4096


def squared_norm_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ‖t‖² in float64 on `device`, without a float64 copy of any tensor: one fused `_foreach_norm` gives each
    tensor's norm in fp32, whose squares are summed in float64 (so a model of any size adds no error across
    tensors). On the CPU each tensor is cut into CPU_NORM_PIECE-element views first, so that the fp32
    accumulation stays as exact as the gradients themselves (CUDA's kernel reduces in a tree already)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    tensors = [t if t.dtype == torch.float32 else t.float() for t in tensors]
    tensors = [piece for t in tensors for piece in (t.reshape(-1).split(CPU_NORM_PIECE) if t.is_cpu else (t,))]
    norms = torch._foreach_norm(tensors)
    return torch.stack(norms).to(device=device, dtype=torch.float64).square().sum()


class LocalGradients:
    """The parameters of `chunks` as this rank holds them, stepped by the optimizer themselves: their `.grad`
    is the gradient (no replica reduces it), zeroed by setting it to None. A parameter is named by its name in
    its chunk, as `DataParallel` names it."""

    frozen_buffers: tuple = ()  # nothing is packed

    def __init__(self, chunks: list[nn.Module]) -> None:
        self.chunks = chunks
        self.grad_sync = [True] * len(chunks)
        self.across = None  # fault-tolerant replica groups (meshlm.parallel.dp.replica_groups.attach)

    def _named(self) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:
            yield from chunk.named_parameters()

    # ---- the backward: nothing to reduce ---------------------------------------------------------------
    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        self.grad_sync[chunk] = enabled

    def check_not_synced(self) -> None:
        pass

    def finish_grad_sync(self) -> None:
        """Nothing to reduce inside the group; across fault-tolerant replica groups, the gradients' sum."""
        if self.across is not None:
            self.across.sum_grads([p for _, p in self.named_steps()])

    def grad_shards_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The gradient of each of `params`, zeros where this rank's backward gave it none (a pipeline-tied
        weight the other end still contributes to)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in params]

    # ---- the optimizer -----------------------------------------------------------------------------------
    def named_steps(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self._named() if p.requires_grad]

    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        params = [p for _, p in self.named_steps()]
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def grad_sq_sum(self, skip: Callable[[nn.Parameter], bool]) -> torch.Tensor:
        device = next(self.chunks[0].parameters()).device
        grads = [p.grad.detach() for _, p in self._named() if p.grad is not None and not skip(p)]
        return squared_norm_sum(grads, device)

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        grads = [p.grad.detach() for _, p in self._named() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    def after_optimizer_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        for _, p in self._named():
            p.grad = None

    # ---- state -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def unsharded_state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for chunk in self.chunks:
            state.update({k: v.detach().float().cpu().clone() for k, v in chunk.state_dict().items()})
        return state

    def sharded_state_dict(
        self, optimizer: torch.optim.Optimizer | None = None, replicas: str = "all"
    ) -> dict[str, list[ShardedTensor]]:
        """Every trainable parameter whole ('model') and, given the optimizer, its per-element states: one rank
        of its replicas holds them all, so `replicas` changes nothing."""
        keys = ["model"] + (optimizer_state_keys(optimizer) if optimizer is not None else [])
        out: dict[str, list[ShardedTensor]] = {key: [] for key in keys}
        for name, p in self.named_steps():
            out["model"].append(ShardedTensor(name, p.shape, 0, p.detach().view(-1)))
            for key in keys[1:]:
                out[key].append(ShardedTensor(name, p.shape, 0, optimizer.state[p][key].view(-1)))
        return out

    def frozen_shards(self) -> list[ShardedTensor]:
        return []
