"""Expert parallelism: each ep rank holds E/ep of every MoE layer's experts; tokens travel to them by all-to-all.

Rank r of the `ep` group keeps experts [r·E/ep, (r+1)·E/ep) of each stacked expert weight (dim 0 of each
of the experts module's own parameters) and gets rows of its own, like a dp rank; the router, attention and every
other weight stay whole. An MoE layer's dispatch (meshlm.model.moe.combine) sorts this rank's (token, slot)
rows by expert and hands them to the experts with the rows per expert; `ShardedExperts` then

    1. exchanges the row counts (all_to_all_single of E integers: what every rank sends to each of mine),
    2. sends each rank the rows of its experts (all_to_all_single with those split sizes),
    3. reorders what it received from (source rank, local expert) to (local expert, source rank), runs its
       local experts over their contiguous rows, and puts the outputs back in the received order,
    4. sends every row back to where it came from (the reverse all_to_all_single: the combine),

so the rows come back in exactly the order they left, and `combine` sums them over the k slots as in one
process. Backward runs the same exchanges in reverse (`AllToAll`). Each rank's expert gradients are sums over
the tokens of every ep rank; they must be averaged over the ranks that hold the same experts (dp × cp, mesh
group "expert_replicas"), not over all data replicas (dp × ep × cp, "replicas"), like the whole weights' are.

Each sharded weight's record in the placement table (meshlm.parallel.placement) gets its Shard over "ep" (dim
0, apart from its shard over "tp", so tensor parallelism's readers never mistake it for theirs) and its
gradient group, "expert_replicas": data parallel reduces (and ZeRO shards) it over that group and divides it,
like every gradient, by the number of per-replica loss terms (meshlm.parallel.dp.data_parallel), without knowing
experts. Checkpoints write it as a box of the full stacked tensor, so a checkpoint saved at one ep size loads
at any other (meshlm.checkpoint.state). Under ep × tp (meshlm.parallel.tp.moe) an expert weight also keeps its
tp slice along its hidden dim (`Placement.shards` gives both), and the ep group is the ranks with the same tp
rank, each exchanging its identical rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.moe import GroupedExperts, MoE
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import PlanError
from meshlm.parallel.placement import Placements, Shard
from meshlm.parallel.timers import comm


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with comm("all_to_all"):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def expert_major_order(received: torch.Tensor, total: int) -> torch.Tensor:
    """`received[s, l]` rows came from rank s for local expert l, laid out source-major; the permutation that
    lists them expert-major (by local expert, then source rank), as the experts' contiguous rows. `total` is
    the number of rows received (the host knows it: the exchange's split sizes), so none is read back here."""
    lengths = received.t().reshape(-1)  # blocks in (l, s) order
    starts = (received.reshape(-1).cumsum(0) - received.reshape(-1)).view_as(received).t().reshape(-1)
    block_starts = lengths.cumsum(0) - lengths
    within = torch.arange(total, device=received.device) - block_starts.repeat_interleave(lengths, output_size=total)
    return starts.repeat_interleave(lengths, output_size=total) + within


class ShardedExperts(GroupedExperts):
    """This ep rank's experts of one MoE layer, reached by all-to-all from every rank's dispatch. The same
    parameters as the GroupedExperts it replaces (its own, stacked along dim 0), holding E/ep experts each."""

    def __init__(self, full: GroupedExperts, group: dist.ProcessGroup, placements: Placements) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        weights = dict(full.named_parameters(recurse=False))  # each stacked along dim 0, one row per expert
        self.n_experts = next(iter(weights.values())).shape[0]
        self.n_local = self.n_experts // self.ep
        self.use_grouped_mm = full.use_grouped_mm
        start = rank * self.n_local
        for name, weight in weights.items():
            local = nn.Parameter(weight.detach()[start : start + self.n_local].clone(), weight.requires_grad)
            # Under ep × tp the record keeps this tp rank's hidden units of each expert.
            placements.move(weight, local, Shard("ep", 0, ((start, self.n_local),)), grad_group="expert_replicas")
            self.register_parameter(name, local)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (rows, dim) sorted by global expert, `counts[e]` rows for expert e; returns their outputs, in
        the same order, computed by the ranks that hold the experts."""
        sent = counts.view(self.ep, self.n_local).contiguous()  # sent[r, l]: my rows for rank r's expert l
        received = torch.empty_like(sent)
        with comm("all_to_all"):
            dist.all_to_all_single(received, sent, group=self.group)
        # The layer's one host read: all_to_all_single takes its split sizes as host ints (gloo and NCCL alike).
        # The same read gives the loop over the experts its rows per expert, which it would read again.
        host = torch.cat([sent.sum(1), received.reshape(-1)]).tolist()
        send_splits, got = host[: self.ep], host[self.ep :]
        recv_splits = [sum(got[r * self.n_local : (r + 1) * self.n_local]) for r in range(self.ep)]
        rows = AllToAll.apply(x, recv_splits, send_splits, self.group)
        order = expert_major_order(received, sum(recv_splits))
        per_expert = received.sum(0) if self.uses_grouped_mm(rows) else torch.tensor(
            [sum(got[e :: self.n_local]) for e in range(self.n_local)]
        )  # fmt: skip
        y = super().forward(rows[order], per_expert)
        return AllToAll.apply(self.restore(y, order), send_splits, recv_splits, self.group)

    @staticmethod
    def restore(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (expert-major) back in the received (source-major) order."""
        out = torch.empty_like(y)
        out[order] = y  # a permutation: deterministic
        return out


def check_ep_model(model: nn.Module, layout: Layout, options: ParallelOptions) -> None:
    """One-line PlanErrors for what expert parallelism cannot do exactly yet, before anything changes."""
    ep = layout.ep
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise PlanError(f"ep={ep}: the model has no mixture-of-experts layers (meshlm.model.moe.MoE) to shard")
    for moe in layers:
        if moe.n_experts % ep:
            raise PlanError(f"model.n_experts ({moe.n_experts}) is not divisible by ep={ep}")
    experts = [p for moe in layers for p in moe.experts.parameters()]
    if options.zero == 3 and any(not p.requires_grad for p in experts):
        raise PlanError(f"ep={ep} with parallel.zero 3 does not support frozen experts yet")


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, placements: Placements) -> int:
    """Shard every MoE layer's experts of `model` over `group` (in place), recording each slice in
    `placements`; return the number of MoE layers. The model is checked first (check_ep_model)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        moe.experts = ShardedExperts(moe.experts, group, placements)
    return len(layers)
