"""Reductions across fault-tolerant replica groups (torchft): the outermost replicate dimension of a run.

A run of `fault.replica_groups` = N groups is N `meshlm launch`es of one config; inside a group every strategy runs
as without them, and rank r of a group meets rank r of every other live group on torchft's process group
(`ProcessGroupGloo`, reconfigured by torchft's Manager at each quorum change). This module owns the one thing the
engine and data parallelism need of that: `Across`, which sums (or takes the max of) a tensor over the live
groups after the in-group reduction, in a FIXED order (all-gather, then sum in the quorum's replica order), so
that every group gets the same bits and the sum equals one process adding the groups' terms in that order, for
any number of groups (gloo's ring all-reduce sums each chunk in a different order from 3 ranks on: 2-5e-7 off).
A failed collective (a dead, stalled or cut-off group) is reported to the Manager, not raised: the step is then
not committed (`Manager.should_commit` is False on every rank that saw it) and is redone at the next quorum.

The engine calls `sum_` on the step's kept-token count (so the loss scale follows the live groups) and on the
loss it reports; data parallelism calls it once per gradient bucket after the in-group all-reduce (`Across.sum_`
from `DataParallel._finish`, after the hybrid replicate all-reduce), and `max_` on its unused-parameter flags;
`LocalGradients` (one rank per group) calls `sum_grads` once per step. Everything else about the groups (quorum,
commit, heal) is the trainer's (meshlm.train.replicas).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class _Manager(Protocol):
    def errored(self) -> object: ...

    def report_error(self, e: Exception) -> None: ...


class Across:
    """Fixed-order reductions over the live replica groups on torchft's process group `pg` (this rank's peers:
    the same group rank of every live group), failures reported to `manager`."""

    def __init__(self, pg: object, manager: _Manager) -> None:
        self.pg, self.manager = pg, manager

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every live group's `tensor`, in the quorum's replica order; None once this step has failed."""
        if self.manager.errored() is not None:
            return None  # the step will not commit: no more traffic for it
        from torch.distributed.distributed_c10d import AllgatherOptions

        outs = [torch.empty_like(tensor) for _ in range(self.pg.size())]
        try:
            self.pg.allgather([outs], [tensor], AllgatherOptions()).wait()
        except Exception as e:
            self.manager.report_error(e)
            return None
        return outs

    @torch.no_grad()
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` ← Σ over the live groups, in replica order (bit-identical on every group)."""
        outs = self.gather(tensor.detach().contiguous())
        if outs is not None and len(outs) > 1:
            total = outs[0].clone()
            for other in outs[1:]:
                total += other
            tensor.copy_(total)
        return tensor

    @torch.no_grad()
    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` ← elementwise max over the live groups."""
        outs = self.gather(tensor.contiguous())
        if outs is not None and len(outs) > 1:
            tensor.copy_(torch.stack(outs).amax(dim=0))
        return tensor

    @torch.no_grad()
    def sum_grads(self, params: list[nn.Parameter]) -> None:
        """One rank per group (no in-group reduction): the gradients of `params` summed across groups in one flat
        buffer; a parameter without a gradient here but with one in another group gets zeros first (it was used
        there, so every group steps it), one without a gradient in any group keeps none (the optimizer skips it)."""
        if not params:
            return
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        self.max_(used)
        stepped = [p for p, u in zip(params, used.tolist(), strict=True) if u]
        for p in stepped:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not stepped:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in stepped])
        self.sum_(flat)
        start = 0
        for p in stepped:
            p.grad.copy_(flat[start : start + p.numel()].view_as(p.grad))
            start += p.numel()


def attach(model: object, across: Across | None) -> None:
    """Route `model`'s (a ParallelModel's) cross-group reductions through `across` (None: no replica groups):
    its token count and reported loss, and its gradients' owner (DataParallel or LocalGradients)."""
    model.across = across
    model.grads.across = across
