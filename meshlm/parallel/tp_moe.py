"""Tensor parallelism inside a mixture-of-experts layer: every expert split over tp (Megatron-Core's expert
tensor parallel size = tp), applied by the plan style `moe` (meshlm.parallel.plan.MOE).

Every tp rank holds the whole router and routes the same tokens the same way (its input is the full residual
stream: attention's row-parallel output is already summed over tp). Each rank keeps a tp-th of every expert's
hidden units, so each expert is a column-parallel gate/up and a row-parallel down, as the dense MLP is:

    experts.gate_proj, experts.up_proj   (E, hidden/tp, dim)   dim 1 of the stacked weights
    experts.down_proj                    (E, dim, hidden/tp)   dim 2
    shared_expert.{gate,up}_proj         rows (hidden/tp, dim); shared_expert.down_proj columns (dim, hidden/tp)
    gate (the router), shared_expert_gate   whole on every rank

each slice tagged with its TPShard (meshlm.parallel.tp_shard), so checkpoints, materialisation, clipping and
ZeRO read it like any tp-sharded weight. The layer opens the tensor-parallel region once on its input
(copy_to_tp; under sequence parallelism an all-gather of the sequence) and closes it once on its output:
the routed and shared outputs are partial sums over hidden units, summed by one all-reduce (under SP a
reduce-scatter back to the sequence shard). Under expert parallelism (ShardedExperts) the all-to-all runs
inside this region over the ep group of ranks with the same tp rank: each tp rank exchanges its (identical)
rows and gets back its partial outputs, which the reduction after the combine sums.

Gradients: each rank gets the full output gradient, but what flows back into the routing weights (and the
shared expert's gate) multiplies this rank's partial outputs, so it is this rank's share. The two replicated
weights that read it, the router and the shared-expert gate, sum their gradients over tp (a hook, as
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
from meshlm.parallel.tp_ops import _all_reduce, copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq

if TYPE_CHECKING:
    from meshlm.parallel.tensor_parallel import TPState

Shard = Callable[[torch.Tensor, int, tuple[tuple[int, int], ...]], nn.Parameter]


class TensorParallelMoE(MoE):
    """This tp rank's share of one MoE layer (see the module docstring): the same module, parameter names
    and settings, with its experts' hidden units split and its output reduced over tp."""

    def __init__(self, moe: MoE, tp: TPState, shard: Shard) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(vars(moe))  # the same layer (parameters, submodules, settings), split below
        self.tp = tp
        self.aux_loss_split = tp.size
        experts = self.experts
        width = experts.gate_proj.shape[1] // tp.size
        mine = ((tp.rank * width, width),)
        experts.gate_proj = shard(experts.gate_proj, 1, mine)
        experts.up_proj = shard(experts.up_proj, 1, mine)
        experts.down_proj = shard(experts.down_proj, 2, mine)
        if self.shared_expert is not None:
            mlp = self.shared_expert
            width = mlp.gate_proj.out_features // tp.size
            mine = ((tp.rank * width, width),)
            mlp.gate_proj.weight = shard(mlp.gate_proj.weight, 0, mine)
            mlp.up_proj.weight = shard(mlp.up_proj.weight, 0, mine)
            mlp.down_proj.weight = shard(mlp.down_proj.weight, 1, mine)
        for linear in (self.gate, self.shared_expert_gate):
            if linear is not None and linear.weight.requires_grad:
                linear.weight.register_hook(lambda grad: _all_reduce(grad, tp.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, sp = self.tp.group, self.tp.sequence_parallel
        partial = super().forward(gather_seq(x, group) if sp else copy_to_tp(x, group))
        return reduce_scatter_seq(partial, group) if sp else reduce_from_tp(partial, group)
