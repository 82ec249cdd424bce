"""Tensor parallelism inside a mixture-of-experts layer: every expert split over tp (Megatron-Core's expert
tensor parallel size = tp), applied to the layers the plan gives the style `SplitMoE` (meshlm.parallel.parallel_plan).

Every tp rank holds the whole router and routes the same tokens the same way (its input is the full residual
stream: attention's row-parallel output is already summed over tp). Each rank keeps a tp-th of every expert's
hidden units, so each expert is a column-parallel up-projection pair and a row-parallel down-projection, as
the dense MLP is: the plan names each split parameter and the dim that indexes its hidden units (dim 1 of
the stacked (E, hidden, dim) weights, dim 2 of the stacked (E, dim, hidden) one, and the shared expert's rows
and columns). Each slice has its Shard over "tp" recorded in the placement table (meshlm.parallel.placement), so
checkpoints, materialisation, clipping and ZeRO read it like any tp-sharded weight. The layer opens the tensor-parallel
region once on its input (copy_to_tp; under sequence parallelism an all-gather of the sequence) and closes
it once on its output: the routed and shared outputs are partial sums over hidden units, summed by one
all-reduce (under SP a reduce-scatter back to the sequence shard). Under expert parallelism (ShardedExperts)
the all-to-all runs inside this region over the ep group of ranks with the same tp rank: each tp rank
exchanges its (identical) rows and gets back its partial outputs, which the reduction after the combine sums.

Gradients: each rank gets the full output gradient, but what flows back into the routing weights (and the
shared expert's gate) multiplies this rank's partial outputs, so it is this rank's share. The layer's whole
parameters, the router and the shared-expert gate, therefore sum their gradients over tp (a hook, as
sequence-parallel norms do); the input's gradient is summed by the region's opening (copy_to_tp's backward or
the gather's reduce-scatter). Every rank measures the same aux losses from the same routing and adds 1/tp of
their gradient (MoE.aux_loss_split), so those sums count them once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshlm.model.moe import MoE
from meshlm.parallel.tp.ops import _all_reduce, copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq

if TYPE_CHECKING:
    from meshlm.parallel.placement import Placements
    from meshlm.parallel.tp.sharding import TPState

ShardFn = Callable[[torch.Tensor, int, tuple[tuple[int, int], ...]], nn.Parameter]


class TensorParallelMoE(MoE):
    """This tp rank's share of one MoE layer (see the module docstring): the same module, parameter names
    and settings, with its experts' hidden units split and its output reduced over tp."""

    def __init__(
        self, moe: MoE, tp: TPState, shard: ShardFn, splits: list[tuple[nn.Module, str, int]], placements: Placements
    ) -> None:
        """`splits`: (owning module, attribute, dim of its hidden units) of each parameter to split (`shard`
        records each slice in `placements`)."""
        nn.Module.__init__(self)
        self.__dict__.update(vars(moe))  # the same layer (parameters, submodules, settings), split below
        self.tp = tp
        self.aux_loss_split = tp.size
        for owner, attr, dim in splits:
            full = getattr(owner, attr)
            width = full.shape[dim] // tp.size
            owner.register_parameter(attr, shard(full, dim, ((tp.rank * width, width),)))
        for param in self.parameters():
            if (
                placements[param].on("tp") is None and param.requires_grad
            ):  # whole: its gradient here is this rank's share
                param.register_hook(lambda grad: _all_reduce(grad, tp.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, sp = self.tp.group, self.tp.sequence_parallel
        partial = super().forward(gather_seq(x, group) if sp else copy_to_tp(x, group))
        return reduce_scatter_seq(partial, group) if sp else reduce_from_tp(partial, group)
