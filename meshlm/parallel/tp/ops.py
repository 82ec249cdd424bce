"""Autograd functions with explicit collectives: the f/g operators of Megatron-LM tensor parallelism
(Shoeybi et al. 2019) and their sequence-parallel counterparts (Korthikanti et al. 2022).

Each op's backward is its partner's forward, so a region entered with one is left with the other:

    op                   forward              backward           where
    copy_to_tp           identity             all-reduce         input of column-parallel linears
    reduce_from_tp       all-reduce           identity           output of row-parallel linears
    gather_from_tp       all-gather (last)    split (last)       full logits for inference
    scatter_to_tp        split (last)         all-gather (last)  the conjugate of gather_from_tp
    gather_seq           all-gather (seq)     reduce-scatter     input of column linears under SP
    reduce_scatter_seq   reduce-scatter       all-gather (seq)   output of row linears under SP

Activations are (batch, seq, features): the sequence dim is 1. Collectives run on the tensors' device
(gloo on CPU, NCCL on GPU); nothing here knows about the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from meshlm.parallel.timers import comm

SEQ_DIM = 1


# ---- raw collectives (no autograd) ----------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place all-reduce: the input may be shared with other autograd branches."""
    out = x.contiguous().clone()
    with comm("all_reduce"):
        dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    with comm("all_gather"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    with comm("reduce_scatter"):
        dist.reduce_scatter(out, parts, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


# ---- the conjugate pairs -------------------------------------------------------------------------
class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherSeq(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterSeq(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; backward sums the partial gradients each rank's shard of the next op produced."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum the partial outputs of the ranks (row-parallel linear); the gradient is already replicated."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dim; backward keeps this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dim of a replicated tensor; backward all-gathers the gradient."""
    return _ScatterToTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sequence shards -> full sequence; backward reduce-scatters the partial full-sequence gradients."""
    return _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum partial full-sequence outputs and keep this rank's sequence shard; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, group)


# ---- sequence-parallel input of the column-parallel linears ---------------------------------------
class _RegatherCache:
    """The full input re-gathered in backward, shared by the linears reading it (q/k/v or gate/up):
    the first one to run backward all-gathers, the others reuse it; it dies with the last reader."""

    def __init__(self) -> None:
        self.full: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class SeqShard:
    """This rank's sequence shard of a gathered input, and the backward re-gather its readers share."""

    shard: torch.Tensor
    cache: _RegatherCache
    group: dist.ProcessGroup


def gather_seq_for_linears(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, SeqShard]:
    """gather_seq, and this rank's shard of it, so that `linear_saving_shard` saves s/tp positions instead
    of s and re-gathers in backward (Korthikanti et al. 2022, §4.2.2)."""
    return gather_seq(x, group), SeqShard(x, _RegatherCache(), group)


class _LinearSavingShard(Function):
    @staticmethod
    def forward(ctx, x_full, weight, x_shard, cache, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.cache, ctx.group = cache, group
        return F.linear(x_full, weight)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        # A second backward through this node (the zero-bubble schedule's W pass) finds the cache dropped and
        # gathers again; every tp rank runs the same passes, so the collectives still match.
        cache = ctx.cache or _RegatherCache()
        if cache.full is None:
            cache.full = _all_gather(x_shard, SEQ_DIM, ctx.group)
        x_full = cache.full.to(grad.dtype)
        ctx.cache = None  # the last reader to finish frees the gathered input
        grad_x = (grad @ weight.to(grad.dtype)).to(x_shard.dtype)
        grad_w = grad.flatten(0, -2).t() @ x_full.flatten(0, -2)
        return grad_x, grad_w.to(weight.dtype), None, None, None


def linear_saving_shard(x: torch.Tensor, weight: torch.Tensor, seq: SeqShard) -> torch.Tensor:
    """F.linear(x, weight) of an input `gather_seq_for_linears` gathered, saving only its shard `seq`."""
    return _LinearSavingShard.apply(x, weight, seq.shard, seq.cache, seq.group)


# ---- replicated KV heads ----------------------------------------------------------------------------
class _SumOverHeadReplicas(Function):
    @staticmethod
    def forward(ctx, weight, head, n_heads, group):
        ctx.head, ctx.n_heads, ctx.group = head, n_heads, group
        return weight

    @staticmethod
    def backward(ctx, grad):
        every_head = grad.new_zeros((ctx.n_heads, *grad.shape))
        every_head[ctx.head] = grad
        with comm("all_reduce"):
            dist.all_reduce(every_head, group=ctx.group)
        return every_head[ctx.head], None, None, None


def sum_over_head_replicas(weight: torch.Tensor, head: int, n_heads: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward on this rank's copy of KV head `head`; backward sums its gradient over every rank
    holding the same head. Each rank writes its gradient into its head's slot of an all-heads buffer, so
    one all-reduce on the tp group serves every head (KV weights are the smallest matrices: the n_heads×
    larger message is cheaper than one process group per head)."""
    return _SumOverHeadReplicas.apply(weight, head, n_heads, group)


# ---- vocab-parallel cross-entropy ------------------------------------------------------------------
class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        x = logits.float().reshape(-1, vocab_local)
        flat_targets = targets.reshape(-1)

        # Stabilising shift by the global max (no gradient: softmax does not depend on it).
        shift = _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX)
        x = x - shift.unsqueeze(-1)
        exp = x.exp()

        # Sum-exp and the target's shifted logit (held by exactly one rank) in one all-reduce. An ignored
        # target (ignore_index, e.g. -100) lies in no rank's slice: its token gets loss 0 and no gradient.
        kept = flat_targets != ignore_index
        local = flat_targets - start
        mine = (local >= 0) & (local < vocab_local) & kept
        local = local.clamp(0, vocab_local - 1)
        target_logit = x.gather(1, local.unsqueeze(1)).squeeze(1) * mine
        sum_exp, target_logit = _all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, kept)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return ((sum_exp.log() - target_logit) * kept).view(targets.shape)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, kept = ctx.saved_tensors
        # d(CE of token t)/d logits = softmax - onehot(target), on this rank's vocab slice; 0 for ignored tokens.
        grad_logits = softmax.scatter_add(1, local.unsqueeze(1), -mine.to(softmax.dtype).unsqueeze(1))
        grad_logits *= (grad.reshape(-1) * kept).unsqueeze(1)
        return grad_logits.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like `targets`, 0 where the target is `ignore_index`) of
    vocab-sharded logits (..., vocab/tp) against global target ids.

    Equals `token_cross_entropy` on the gathered logits without ever gathering them: three numbers per
    token cross the wire (max, sum-exp, target logit) instead of vocab/tp logits. Every tp rank gets the
    same losses; the gradient is this rank's slice of softmax - onehot.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)
