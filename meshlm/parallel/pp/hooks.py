"""Pipeline parallel's run-time hooks (meshlm.parallel.contract.Applied) and products: the stages this rank
holds (`chunks`) and the schedule that runs them (`parts["pipeline"]`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.contract import Applied, Gradients
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.pp.pipeline import PipelineSchedule, TiedStages


class PipelineHooks(Applied):
    """The schedule runs the micro-batches; the last stage's loss is every stage's; the two ends' copies of a
    tied weight get the sum of their gradients, after data parallel reduced each (end_backward runs last
    applied first; `grads`, the gradients' owner, holds what to sum)."""

    def __init__(
        self, schedule: PipelineSchedule, tied: TiedStages | None, mesh: Mesh, chunks: list[nn.Module]
    ) -> None:
        self.schedule, self.tied, self.mesh, self.chunks = schedule, tied, mesh, chunks
        self.parts = MappingProxyType({"pipeline": schedule})

    def run_micro_batches(
        self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor], train: bool
    ) -> torch.Tensor:
        if train:
            return self.schedule.train_step(micro_inputs, micro_targets)
        return self.schedule.eval_step(micro_inputs, micro_targets)

    def check_direct_call(self) -> None:
        raise RuntimeError("under pipeline parallelism call forward_backward(inputs, targets, loss_fn)")

    def end_backward(self, step: bool, grads: Gradients) -> None:
        if step and self.tied is not None:
            self.tied.all_reduce_grads(grads.grad_shards_of(self.tied.params))

    def share_loss(self, loss: torch.Tensor) -> None:
        self.schedule.broadcast_from_last_stage(loss)

    def gather_state(
        self, state: dict[str, torch.Tensor], params: Mapping[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        """Every stage's tensors, on every rank of the pipeline."""
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.mesh.size("pp")
        dist.all_gather_object(parts, state, group=self.mesh.group("pp"))
        return {k: v for part in parts for k, v in part.items()}
