"""Data parallel's run-time hooks (meshlm.parallel.contract.Applied) and products: the gradients' owner
(`grads`: DataParallel, or the local parameters') and, where replicas reduce or ZeRO shards, the DataParallel
object (`parts["dp"]`)."""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.distributed as dist

from meshlm.parallel.contract import Applied, Gradients
from meshlm.parallel.dp.data_parallel import DataParallel
from meshlm.parallel.dp.gradients import LocalGradients
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.parallel_plan import PlanError
from meshlm.parallel.timers import comm


class DataParallelHooks(Applied):
    """Each replica (dp × ep ranks) gets rows of its own; its gradients (`grads`: DataParallel, or the local
    parameters') are reduced when the step's backward ends, and never under accumulation's inner backwards."""

    def __init__(self, grads: LocalGradients | DataParallel, mesh: Mesh, dp: DataParallel | None) -> None:
        self.grads, self.mesh = grads, mesh
        self.parts = MappingProxyType({"dp": dp})
        self.batch_checked = False

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        dp, rank = self.mesh.size("batch"), self.mesh.rank("batch")
        if batch.shape[0] % dp:
            raise ValueError(f"global batch of {batch.shape[0]} rows does not split over dp={dp}")
        rows = batch.shape[0] // dp
        return batch[rank * rows : (rank + 1) * rows]

    def check_batch(self, inputs: torch.Tensor) -> None:
        """Once: each replica got rows of its own (the same rows on every replica is a global batch passed where
        a local one belongs)."""
        dp = self.mesh.size("batch")
        if self.batch_checked or dp == 1:
            return
        positions = torch.arange(1, inputs.numel() + 1, dtype=torch.float64, device=inputs.device)
        fingerprint = (inputs.double().flatten() * positions).sum()  # order-sensitive: equal only for equal rows
        seen = [torch.zeros_like(fingerprint) for _ in range(dp)]
        with comm("all_gather"):
            dist.all_gather(seen, fingerprint, group=self.mesh.group("batch"))
        if all(torch.equal(seen[0], f) for f in seen[1:]):
            raise PlanError(
                f"forward_backward: every one of the {dp} dp ranks got the same {inputs.shape[0]} rows; pass each "
                "rank its own share of the global batch (model.local_batch(batch))"
            )
        self.batch_checked = True

    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        self.grads.set_grad_sync(chunk, enabled)

    def start_backward(self) -> None:
        self.grads.check_not_synced()

    def end_backward(self, step: bool, grads: Gradients) -> None:
        """The step's end, or (a loop of one's own) a backward outside `no_sync`: wait for the reductions."""
        if step or all(self.grads.grad_sync):
            self.grads.finish_grad_sync()
