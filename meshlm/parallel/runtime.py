"""What an applied strategy does at run time: the hooks ParallelModel runs, for every applied strategy in order.

`Strategy.apply` (meshlm.parallel.strategies) transforms the model and returns an `Applied`: the strategy's
part of every step. ParallelModel keeps the loss contract (per-token losses over the kept tokens of the global
batch) and runs these hooks, naming no parallelism itself:

  local_rows(batch)            this replica's rows of a global batch (data parallel)
  check_batch(inputs)          refuse a batch the layout cannot have been meant to get (data parallel)
  shard_sequence(batch)        this rank's part of every sequence (context parallel)
  run_micro_batches(...)       run the step's micro-batches itself, returning this rank's loss (pipeline);
                               None leaves them to the engine's plain loop
  check_direct_call()          refuse calling the model directly (pipeline)
  set_grad_sync(chunk, on)     whether the next backward of a chunk reduces gradients (data parallel)
  start_backward()             before any backward (data parallel: not on top of reduced gradients)
  end_backward(step)           after the backward; run in reverse order, so that data parallel has reduced
                               the gradients before the pipeline sums its tied weights' over both ends
  share_loss(loss)             make this rank's loss the one its replica reports (pipeline: the last stage's)
  gather_state(state, model)   this rank's full-precision state dict -> gathered over its dimension

Which gradients and optimizer tensors exist is the business of one object, `Build.grads`
(meshlm.parallel.gradients), which data parallel sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.plan import PlanError
from meshlm.parallel.timers import comm

if TYPE_CHECKING:
    from meshlm.parallel.data_parallel import DataParallel
    from meshlm.parallel.engine import ParallelModel
    from meshlm.parallel.gradients import LocalGradients
    from meshlm.parallel.mesh import Mesh
    from meshlm.parallel.pipeline import PipelineSchedule, TiedStages
    from meshlm.parallel.strategies import Build


class Applied:
    """The run-time hooks of an applied strategy; each default leaves the step as it is."""

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def check_batch(self, inputs: torch.Tensor) -> None:
        pass

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def run_micro_batches(
        self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor], train: bool
    ) -> torch.Tensor | None:
        return None

    def check_direct_call(self) -> None:
        pass

    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        pass

    def start_backward(self) -> None:
        pass

    def end_backward(self, step: bool) -> None:
        """`step`: the step's backward is over (forward_backward); else one backward of a loop of one's own."""

    def share_loss(self, loss: torch.Tensor) -> None:
        pass

    def gather_state(self, state: dict[str, torch.Tensor], model: ParallelModel) -> dict[str, torch.Tensor]:
        return state


def held_params(model: ParallelModel) -> dict[str, nn.Parameter]:
    """Every name under which this rank's chunks hold a parameter (tied aliases included)."""
    return {n: p for chunk in model.chunks for n, p in chunk.named_parameters(remove_duplicate=False)}


class TensorParallelHooks(Applied):
    def gather_state(self, state: dict[str, torch.Tensor], model: ParallelModel) -> dict[str, torch.Tensor]:
        from meshlm.parallel.placement import unshard

        return unshard(state, held_params(model), model.placements, "tp", model.mesh.group("tp"))


class ContextParallelHooks(Applied):
    def __init__(self, mesh: Mesh) -> None:
        self.size, self.rank = mesh.size("cp"), mesh.rank("cp")

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        from meshlm.parallel.context_parallel import shard_sequence

        return shard_sequence(batch, self.size, self.rank)


class ExpertParallelHooks(Applied):
    def gather_state(self, state: dict[str, torch.Tensor], model: ParallelModel) -> dict[str, torch.Tensor]:
        from meshlm.parallel.placement import unshard

        return unshard(state, held_params(model), model.placements, "ep", model.mesh.group("ep"))


class PipelineHooks(Applied):
    """The schedule runs the micro-batches; the last stage's loss is every stage's; the two ends' copies of a
    tied weight get the sum of their gradients (after data parallel reduced each: `build.grads`, which it sets
    after this strategy is applied)."""

    def __init__(self, schedule: PipelineSchedule, tied: TiedStages | None, build: Build) -> None:
        self.schedule, self.tied, self.build, self.mesh = schedule, tied, build, build.mesh

    def run_micro_batches(
        self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor], train: bool
    ) -> torch.Tensor:
        if train:
            return self.schedule.train_step(micro_inputs, micro_targets)
        return self.schedule.eval_step(micro_inputs, micro_targets)

    def check_direct_call(self) -> None:
        raise RuntimeError("under pipeline parallelism call forward_backward(inputs, targets, loss_fn)")

    def end_backward(self, step: bool) -> None:
        if step and self.tied is not None:
            self.tied.all_reduce_grads(self.build.grads.grad_shards_of(self.tied.params))

    def share_loss(self, loss: torch.Tensor) -> None:
        self.schedule.broadcast_from_last_stage(loss)

    def gather_state(self, state: dict[str, torch.Tensor], model: ParallelModel) -> dict[str, torch.Tensor]:
        """Every stage's tensors, on every rank of the pipeline."""
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.mesh.size("pp")
        dist.all_gather_object(parts, state, group=self.mesh.group("pp"))
        return {k: v for part in parts for k, v in part.items()}


class DataParallelHooks(Applied):
    """Each replica (dp × ep ranks) gets rows of its own; its gradients (`grads`: DataParallel, or the local
    parameters') are reduced when the step's backward ends, and never under accumulation's inner backwards."""

    def __init__(self, grads: LocalGradients | DataParallel, mesh: Mesh) -> None:
        self.grads, self.mesh = grads, mesh
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

    def end_backward(self, step: bool) -> None:
        """The step's end, or (a loop of one's own) a backward outside `no_sync`: wait for the reductions."""
        if step or all(self.grads.grad_sync):
            self.grads.finish_grad_sync()
