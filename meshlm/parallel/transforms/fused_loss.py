"""Fused, chunked output projection + cross-entropy: the loss of a causal LM without its logits.

The unfused loss materialises the logits of every token — batch × seq × vocab, 4 GiB in fp32 for 4×2048 tokens
and a 128k vocabulary — and keeps them (or the softmax) for backward. Here the head's forward returns a
`HeadOutput` (its input and its weight) instead, and the loss walks the tokens in chunks: for each chunk it
computes the chunk's logits, its per-token cross-entropy and, at once, the gradients of the loss with respect
to the chunk's hidden states and to the head weight (the chunk's logits are then dropped). Backward only
scales them by the incoming gradient. The loss is the *sum* over kept tokens (targets ≠ ignore_index), whose
gradient is the same for every token — the scalar the engine multiplies by — which is what makes computing the
gradients in forward exact (Liger-Kernel's fused linear cross-entropy does the same).

Under tensor parallelism the weight is this rank's vocabulary slice: each chunk's max, sum-exp and target
logit are all-reduced over tp (three numbers per token, as in the vocabulary-parallel cross-entropy), the
weight gradient is this rank's slice, and the hidden-state gradient is this rank's partial sum, which the
head's own input region (Megatron's f operator, whose backward all-reduces) completes, as for the unfused head.
The same FLOPs as the unfused head: one logits GEMM and two gradient GEMMs per token.

Under ZeRO-3 the head's gathered weight outlives the head's forward: the unit's post-forward hook hands the
HeadOutput a `release` (meshlm.parallel.dp.zero.Zero3Hooks) instead of freeing the weight, and the loss calls it
once its forward has run. Backward needs no weight (only the gradients computed in forward), so the weight is
not gathered again for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from meshlm.parallel.parallel_plan import VOCAB_HEAD, ParallelPlan, tp_modules
from meshlm.parallel.timers import comm

CHUNK_ELEMENTS = 1 << 25  # logits per chunk: 32M (128 MiB in fp32), ~256 tokens at a 128k vocabulary slice


@dataclass
class HeadOutput:
    """What a fused head returns instead of logits: its input (after the head's tp region) and weight, and
    under ZeRO-3 `release`, which frees the weight's gathered unit(s) once the loss has used it."""

    hidden: torch.Tensor
    weight: torch.Tensor
    group: dist.ProcessGroup | None = None  # tp group: the weight is a vocabulary slice
    release: Callable[[], None] | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))


def _all_reduce_in_place(
    x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> None:
    if group is not None:
        with comm("all_reduce"):
            dist.all_reduce(x, op=op, group=group)


class _FusedLinearCrossEntropy(Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, group):
        vocab_local = weight.shape[0]
        start = dist.get_rank(group) * vocab_local if group is not None else 0
        h = hidden.reshape(-1, hidden.shape[-1])
        flat = targets.reshape(-1)
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        w = weight.to(dtype)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = max(1, CHUNK_ELEMENTS // vocab_local)
        for lo in range(0, h.shape[0], step):
            hc, tc = h[lo : lo + step].to(dtype), flat[lo : lo + step]
            logits = (hc @ w.t()).float()
            shift = logits.max(dim=-1).values
            _all_reduce_in_place(shift, group, dist.ReduceOp.MAX)
            logits -= shift.unsqueeze(-1)
            kept = tc != ignore_index
            local = tc - start
            mine = (local >= 0) & (local < vocab_local) & kept
            local = local.clamp(0, vocab_local - 1)
            # The target's shifted logit, held by one rank (ignored targets by none), and Σexp: one all-reduce.
            target_logit = logits.gather(1, local.unsqueeze(1)).squeeze(1) * mine
            exp = logits.exp_()
            sums = torch.stack([exp.sum(dim=-1), target_logit])
            _all_reduce_in_place(sums, group)
            sum_exp, target_logit = sums
            total += ((sum_exp.log() - target_logit) * kept).sum()
            # d loss / d logits = softmax - onehot(target) on this rank's slice, 0 for ignored tokens.
            grad_logits = exp.div_(sum_exp.unsqueeze(-1))
            grad_logits.scatter_add_(1, local.unsqueeze(1), -mine.float().unsqueeze(1))
            grad_logits *= kept.unsqueeze(1)
            grad_logits = grad_logits.to(dtype)
            grad_h[lo : lo + step] = (grad_logits @ w).to(h.dtype)
            grad_w += (grad_logits.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad).view(ctx.hidden_shape), (grad_w * grad).to(ctx.weight_dtype), None, None, None


def fused_cross_entropy_sum(head: HeadOutput, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Σ over kept targets of the cross-entropy of `head`'s logits (fp32), computed chunk by chunk without
    materialising them; equal to `token_cross_entropy(logits, targets).sum()` on the full logits. Then the
    head's weight is released (ZeRO-3 frees its gathered unit): backward does not read it."""
    try:
        return _FusedLinearCrossEntropy.apply(head.hidden, head.weight, targets, ignore_index, head.group)
    finally:
        if head.release is not None:
            head.release()
            head.release = None


class FusedLinearHead(nn.Linear):
    """A bias-free nn.Linear vocabulary head whose forward, in training, returns a HeadOutput for the fused loss
    (and logits in eval). `apply_fused_loss` turns a model's head into one in place, keeping its parameter,
    its name and any tie."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | HeadOutput:
        return HeadOutput(x, self.weight) if self.training else super().forward(x)


def apply_fused_loss(model: nn.Module, plan: ParallelPlan) -> bool:
    """Make the plan's vocabulary heads (VOCAB_HEAD) return a HeadOutput in training; True if there was one.
    A tensor-parallel head (ColumnParallelLinear) gets its `fused_loss` flag; a plain bias-free nn.Linear
    becomes a FusedLinearHead. A head with a bias keeps its logits (the unfused loss)."""
    fused = False
    for _, module, style in tp_modules(model, plan):
        if style != VOCAB_HEAD or getattr(module, "bias", None) is not None:
            continue
        if hasattr(module, "fused_loss"):  # a tp ColumnParallelLinear vocabulary head
            module.fused_loss = fused = True
        elif type(module) is nn.Linear:
            module.__class__ = FusedLinearHead  # same parameters, hooks and ties; only forward changes
            fused = True
    return fused
