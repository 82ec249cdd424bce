"""Fused, chunked output projection + cross-entropy: the loss of a causal LM without its logits.

The unfused loss materialises the logits of every token — batch × seq × vocab, 4 GiB in fp32 for 4×2048 tokens
and a 128k vocabulary — and keeps them (or the softmax) for backward. Here the head's forward returns a
`HeadOutput` (its input and its weight) instead, and the loss walks the tokens in chunks: for each chunk it
computes the chunk's logits, its per-token cross-entropy and, at once, the gradients of the loss with respect
to the chunk's hidden states and to the head weight (the chunk's logits are then dropped). Backward only
scales them by the incoming gradient. The loss is the *sum* over kept tokens (targets ≠ ignore_index), whose
gradient is the same for every token — the scalar the engine multiplies by — which is what makes computing the
gradients in forward exact (Liger-Kernel's fused linear cross-entropy does the same).

**Chunks by a memory budget.** A chunk holds `CHUNK_BYTES` (1 GiB) of fp32 logits at most: 2,048 tokens at a
128k vocabulary slice, 8,192 at 32k (`chunk_tokens`; meshlm.plan.memory.LOSS_CHUNK_BYTES is the planner's copy).
Each chunk re-reads the head weight and updates the fp32 weight gradient, so a chunk of thousands of tokens
keeps that traffic a few percent of the chunk's GEMMs; a micro-batch whose logits fit the budget runs in one
chunk: the unfused computation without the kept logits, faster and lighter than the unfused loss
(benchmarks/fused_loss.py, docs/benchmarks.md).

**The weight gradient is summed over chunks in fp32, never rounded to bf16 per chunk** (each chunk's bf16
partial rounded before the sum drifted 5e-5 from the unfused gradient). In fp32 every GEMM is fp32 and the
weight-gradient GEMM accumulates in place (`addmm_`). Under bf16 autocast the GEMMs take bf16 operands and the
weight-gradient GEMM writes fp32 (`_WeightGrad`): on CUDA a bf16 GEMM whose epilogue accumulates into the fp32
gradient (`torch.addmm(acc, ..., out_dtype=torch.float32, out=acc)`), or with an older torch a bf16 GEMM with
fp32 output added to it (`torch.mm(..., out_dtype=)`). A device whose bf16 GEMM cannot write fp32 (the CPU)
would have to upcast the operands to an fp32 GEMM, ~3× slower than bf16 there (0.66 s vs 0.23 s for 1,024
tokens × 32k × 512 on this repo's 2-core CPU; chunked so, the loss was slower than unfused), so there it runs
in one chunk whatever the budget: its one
bf16 weight-gradient product is rounded once, as the unfused head's is, and it still keeps no logits.

**Compiled with the blocks.** With `compile` on (train.compile), the chunk's elementwise body — the fp32 upcast,
max, exp, sum, log, the softmax gradient and its cast — is torch.compiled with the blocks' backend into a few
fused kernels (`HeadOutput.compile_backend`, set by `apply_fused_loss`); the GEMMs stay the library's. Under
tensor parallelism the body all-reduces between its steps and stays eager.

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
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from meshlm.parallel.parallel_plan import VOCAB_HEAD, ParallelPlan, tp_modules
from meshlm.parallel.timers import comm

CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk: 1 GiB, 2,048 tokens at a 128k vocabulary slice


def chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk of the fused loss: as many as keep one chunk's fp32 logits within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab_local))


@dataclass
class HeadOutput:
    """What a fused head returns instead of logits: its input (after the head's tp region) and weight, and
    under ZeRO-3 `release`, which frees the weight's gathered unit(s) once the loss has used it;
    `compile_backend` compiles the loss's chunk body (train.compile on)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    group: dist.ProcessGroup | None = None  # tp group: the weight is a vocabulary slice
    release: Callable[[], None] | None = None
    compile_backend: str | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))


def _all_reduce_in_place(
    x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> None:
    if group is not None:
        with comm("all_reduce"):
            dist.all_reduce(x, op=op, group=group)


def _softmax_grad(
    logits: torch.Tensor,
    local: torch.Tensor,
    mine: torch.Tensor,
    kept: torch.Tensor,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss sum and d loss / d logits (softmax − onehot(target) on this rank's slice, 0 for ignored
    tokens) in `dtype`, the GEMMs' operand type. In place on the fp32 logits."""
    logits = logits.float()
    shift = logits.amax(dim=-1)
    _all_reduce_in_place(shift, group, dist.ReduceOp.MAX)
    logits -= shift.unsqueeze(-1)
    # The target's shifted logit, held by one rank (ignored targets by none), and Σexp: one all-reduce.
    target_logit = logits.gather(1, local.unsqueeze(1)).squeeze(1) * mine
    exp = logits.exp_()
    sums = torch.stack([exp.sum(dim=-1), target_logit])
    _all_reduce_in_place(sums, group)
    sum_exp, target_logit = sums
    loss = ((sum_exp.log() - target_logit) * kept).sum()
    # softmax of kept tokens, 0 for ignored ones (exp ≤ 1 over an infinite sum) in one pass: sum / 1 is exact.
    grad = exp.div_((sum_exp / kept).unsqueeze(-1))
    grad.scatter_add_(1, local.unsqueeze(1), -mine.float().unsqueeze(1))
    return loss, grad.to(dtype)


@cache
def _compiled_softmax_grad(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return torch.compile(_softmax_grad, backend=backend)


@cache
def _fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> str:
    """How this device's `dtype` (bf16, fp16) GEMM can write fp32: "addmm" (accumulating into an fp32 tensor
    in the GEMM, torch.addmm(..., out_dtype=, out=)), "mm" (a fresh fp32 result, torch.mm(..., out_dtype=)), or
    "none" (CPU in torch 2.13). Probed once per device and dtype on 2×2 tensors, checked against the fp32
    product."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    acc = torch.ones(2, 2, device=device)
    want = acc + a @ a
    low = a.to(dtype)
    try:
        torch.addmm(acc, low, low, out_dtype=torch.float32, out=acc)
        if torch.equal(acc, want):
            return "addmm"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    try:
        if torch.equal(torch.mm(low, low, out_dtype=torch.float32) + 1, want):
            return "mm"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    return "none"


def tokens_per_chunk(tokens: int, vocab_local: int, device: torch.device, dtype: torch.dtype) -> int:
    """Tokens per chunk of a loss over `tokens` computing in `dtype`: the budget's (`chunk_tokens`), or all of
    them, one chunk, under bf16 on a device whose bf16 GEMM cannot write fp32 (the CPU: see the module)."""
    if dtype != torch.float32 and _fp32_output_gemm(device, dtype) == "none":
        return tokens
    return min(tokens, chunk_tokens(vocab_local))


class _WeightGrad:
    """The head weight's fp32 gradient, summed over chunks without rounding any chunk's partial to bf16: in an
    fp32 run the GEMM accumulates in place; under bf16 the device's fp32-output GEMM (`_fp32_output_gemm`)
    does, and a device without one runs the loss in one chunk (`tokens_per_chunk`), whose one bf16 product is
    rounded once, as the unfused head's."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight
        self.acc: torch.Tensor | None = None  # the first chunk's product starts it (no zero-filled pass)
        self.gemm = "fp32" if dtype == torch.float32 else _fp32_output_gemm(weight.device, dtype)

    def add(self, grad: torch.Tensor, hidden: torch.Tensor) -> None:
        """acc += gradᵀ · hidden for one chunk (grad: d loss / d logits, tokens × vocab slice)."""
        if self.acc is None:
            if self.gemm in ("addmm", "mm"):
                self.acc = torch.mm(grad.t(), hidden, out_dtype=torch.float32)
            else:  # fp32, or the one chunk of a device without an fp32-output bf16 GEMM
                self.acc = (grad.t() @ hidden).float()
        elif self.gemm == "fp32":
            self.acc.addmm_(grad.t(), hidden)
        elif self.gemm == "addmm":
            torch.addmm(self.acc, grad.t(), hidden, out_dtype=torch.float32, out=self.acc)
        else:
            self.acc += torch.mm(grad.t(), hidden, out_dtype=torch.float32)

    def total(self) -> torch.Tensor:
        """The summed fp32 gradient (zeros when there were no tokens)."""
        if self.acc is None:
            return torch.zeros(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        return self.acc


class _FusedLinearCrossEntropy(Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, group, compile_backend):
        vocab_local = weight.shape[0]
        start = dist.get_rank(group) * vocab_local if group is not None else 0
        h = hidden.reshape(-1, hidden.shape[-1])
        flat = targets.reshape(-1)
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        w = weight.to(dtype)
        grad_h = torch.empty_like(h)
        grad_w = _WeightGrad(weight, dtype)
        step = tokens_per_chunk(h.shape[0], vocab_local, weight.device, dtype)
        body = _softmax_grad
        if compile_backend is not None and group is None:  # under tp the body all-reduces: eager
            body = _compiled_softmax_grad(compile_backend)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # the operands are in `dtype` already
            for lo in range(0, h.shape[0], step):
                hc, tc = h[lo : lo + step].to(dtype), flat[lo : lo + step]
                kept = tc != ignore_index
                local = tc - start
                mine = (local >= 0) & (local < vocab_local) & kept
                local = local.clamp(0, vocab_local - 1)
                loss, grad = body(hc @ w.t(), local, mine, kept, group, dtype)
                total += loss
                grad_h[lo : lo + step] = (grad @ w).to(h.dtype)
                grad_w.add(grad, hc)
        ctx.save_for_backward(grad_h, grad_w.total())
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad).view(ctx.hidden_shape), (grad_w * grad).to(ctx.weight_dtype), None, None, None, None


def fused_cross_entropy_sum(head: HeadOutput, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Σ over kept targets of the cross-entropy of `head`'s logits (fp32), computed chunk by chunk without
    materialising them; equal to `token_cross_entropy(logits, targets).sum()` on the full logits. Then the
    head's weight is released (ZeRO-3 frees its gathered unit): backward does not read it."""
    try:
        return _FusedLinearCrossEntropy.apply(
            head.hidden, head.weight, targets, ignore_index, head.group, head.compile_backend
        )
    finally:
        if head.release is not None:
            head.release()
            head.release = None


class FusedLinearHead(nn.Linear):
    """A bias-free nn.Linear vocabulary head whose forward, in training, returns a HeadOutput for the fused loss
    (and logits in eval). `apply_fused_loss` turns a model's head into one in place, keeping its parameter,
    its name and any tie."""

    compile_backend: str | None = None  # the blocks' torch.compile backend, for the loss's chunk body

    def forward(self, x: torch.Tensor) -> torch.Tensor | HeadOutput:
        if self.training:
            return HeadOutput(x, self.weight, compile_backend=self.compile_backend)
        return super().forward(x)


def apply_fused_loss(model: nn.Module, plan: ParallelPlan, compile_backend: str | None = None) -> bool:
    """Make the plan's vocabulary heads (VOCAB_HEAD) return a HeadOutput in training; True if there was one.
    A tensor-parallel head (ColumnParallelLinear) gets its `fused_loss` flag; a plain bias-free nn.Linear
    becomes a FusedLinearHead, whose loss compiles its chunk body with `compile_backend` (train.compile on;
    None: eager). A head with a bias keeps its logits (the unfused loss)."""
    fused = False
    for _, module, style in tp_modules(model, plan):
        if style != VOCAB_HEAD or getattr(module, "bias", None) is not None:
            continue
        if hasattr(module, "fused_loss"):  # a tp ColumnParallelLinear vocabulary head
            module.fused_loss = fused = True
        elif type(module) is nn.Linear:
            module.__class__ = FusedLinearHead  # same parameters, hooks and ties; only forward changes
            module.compile_backend = compile_backend
            fused = True
    return fused
