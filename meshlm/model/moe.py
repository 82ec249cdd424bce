"""Mixture-of-experts feed-forward for meshlm's decoder: a top-k router, dropless dispatch, stacked experts.

One MoE layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024):

    logits = x · W_routerᵀ                            (tokens, n_experts)
    scores = softmax(logits)  or  sigmoid(logits)     in fp32
    w, e   = top-k of scores per token                (renormalised to sum 1 with norm_topk)
    y      = Σ_k w_k · SwiGLU_{e_k}(x)  [+ shared expert, optionally scaled by sigmoid(x · w_gate)]

Dispatch is dropless: every token reaches all of its k experts (no capacity factor). The (token, slot)
pairs are sorted by expert, each expert runs one matmul over its contiguous rows — a grouped GEMM
(`torch._grouped_mm`) on a CUDA device that has it, a loop over the experts elsewhere — and the outputs are
put back in (token, slot) order and summed over the k slots, in that fixed order (deterministic, no atomics).
The experts' weights are stacked 3-D parameters (n_experts, out, in), so expert parallelism can shard dim 0.

Auxiliary losses (their gradient is added in backward by `MoEAuxLossAutoScaler`, the way Megatron-Core does,
so the training loss, pipeline schedules and gradient accumulation are unchanged):

    load balancing  n_experts · Σ_e f_e · P_e      f_e: fraction of the k·s (token, slot) choices that picked e,
                                                    times k (so Σ_e f_e = k); P_e: mean routing probability of e
    z-loss          mean over tokens of logsumexp(logits)²                               (ST-MoE, Zoph et al. 2022)

Normalisation, chosen so the total is the same under every layout: the balancing loss is computed **per
sequence** (f and P over one sequence's tokens) and averaged over the micro-batch's sequences; the z-loss is
a mean over the micro-batch's tokens. A sequence never straddles a data-parallel replica, a micro-batch or a
pipeline stage, so the mean over the global batch — what the gradient is of, after the 1/n_micro scale below
and data parallel's mean over replicas — does not depend on how the batch is cut. (Megatron's per-micro-batch
statistic changes with the micro-batch size: f·P is a product of means, not a mean.) On one sequence it is
exactly transformers' `load_balancing_loss_func` (Mixtral, Qwen-MoE), which pools all the rows it is given.
Padding is routed and counted like any token. Each MoE layer adds `aux_loss_coef · aux + z_loss_coef · z`.

Under context parallelism each rank routes its shard of every sequence (`set_sequence_group`): the balancing
loss's per-sequence sums — choices per expert and routing probability per expert — are summed over the cp
group by an all-reduce whose backward all-reduces the gradient (`SumOverShards`), so every cp rank holds the
full sequence's loss and, once data parallel has averaged the cp ranks' gradients, the gradient of one
process. The z-loss needs nothing: it is a per-token mean, and the cp ranks hold equally many tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.model.config import ModelConfig


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output` in forward; in backward it also sends gradient `scale` into `aux_loss`, so that
    d(total)/dθ gains scale · d(aux_loss)/dθ wherever `output` takes part in the loss (Megatron-Core's
    MoEAuxLossAutoScaler). `scale` is 1/n_micro under gradient accumulation (set_aux_loss_scale)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class SumOverShards(torch.autograd.Function):
    """all_reduce(sum) over `group` in forward and, in backward, of the gradient: every rank's loss is a
    function of the sum, so each input's gradient is the sum of what every rank's loss sends back."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Switch/Mixtral balancing loss per sequence, averaged over sequences. `probs` (batch, seq, n_experts)
    are routing probabilities summing to 1 per token, `experts` (batch, seq, k) the chosen experts. With
    `group` (context parallel) each rank holds an equal shard of every sequence: the per-sequence sums are
    taken over the whole group, so every rank returns the loss of the full sequences."""
    b, s, k = experts.shape
    counts = torch.zeros(b, n_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, experts.reshape(b, s * k), torch.ones(b, s * k, dtype=probs.dtype, device=probs.device))
    sums = torch.stack([counts, probs.sum(1)])  # choices and probability mass per expert, per sequence
    if group is not None:
        sums = SumOverShards.apply(sums, group)
        s *= dist.get_world_size(group)
    per_sequence = n_experts * ((sums[0] / s) * (sums[1] / s)).sum(-1)
    return per_sequence.mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of logsumexp(logits)², keeping router logits small."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can run this expert matmul: a CUDA tensor on a device of compute capability
    9.0+ (Hopper; the kernel's requirement), bf16 under autocast or in bf16 already, rows 16-byte aligned."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    bf16 = x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    )
    return bf16 and x.shape[-1] % 8 == 0


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs as three stacked weights in F.linear's (out, in) layout per expert:
    gate_proj, up_proj (n_experts, moe_intermediate_size, dim) and down_proj (n_experts, dim, moe_intermediate_size)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.use_grouped_mm = True  # where grouped_mm_available; False forces the per-expert loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (rows, dim) sorted by expert, `counts[e]` rows for expert e; returns (rows, dim)."""
        return self.grouped(x, counts) if self.uses_grouped_mm(x) else self.loop(x, counts)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, ...)` runs the grouped GEMMs (else the loop, which reads the counts on the host)."""
        return self.use_grouped_mm and grouped_mm_available(x) and self.gate_proj.shape[1] % 8 == 0  # h's rows too

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference: one SwiGLU per expert over its rows (a host sync for the counts)."""
        # unbind: one backward that stacks the experts' gradients (indexing each would add a zero-padded copy)
        gates, ups, downs = self.gate_proj.unbind(0), self.up_proj.unbind(0), self.down_proj.unbind(0)
        outputs = []
        for e, rows in enumerate(x.split(counts.tolist())):
            if len(rows):
                h = F.silu(F.linear(rows, gates[e])) * F.linear(rows, ups[e])
                outputs.append(F.linear(h, downs[e]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.down_proj.shape[1])

    def grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All experts in three grouped GEMMs, in bf16, with no host sync."""
        offs = counts.cumsum(0).to(torch.int32)
        x = x.to(torch.bfloat16)
        gate, up, down = (
            w.to(torch.bfloat16).transpose(-2, -1) for w in (self.gate_proj, self.up_proj, self.down_proj)
        )
        h = F.silu(torch._grouped_mm(x, gate, offs=offs)) * torch._grouped_mm(x, up, offs=offs)
        return torch._grouped_mm(h, down, offs=offs)


class MoE(nn.Module):
    """A token-choice top-k MoE feed-forward (see the module docstring). Parameter names follow Hugging Face
    Qwen2-MoE: `gate` is the router (n_experts, dim), `experts.{gate,up,down}_proj` the stacked experts,
    `shared_expert` and `shared_expert_gate` the optional shared expert.

    How the layer's aux losses enter a parallel run are its settings, given here (default: one process) and
    changed only by meshlm's setters of them: `sequence_group`, the ranks holding other shards of the same
    sequences (context parallel, set_sequence_group); `aux_loss_scale`, the gradient scale of this
    micro-batch's aux losses (1/n_micro, set_aux_loss_scale); `aux_loss_split`, the ranks that each measure
    the same aux losses and sum their router gradients (tensor parallel: tp, meshlm.parallel.tp.moe), each
    adding 1/aux_loss_split of the aux gradient."""

    def __init__(
        self,
        cfg: ModelConfig,
        shared_expert: nn.Module | None = None,
        *,
        sequence_group: dist.ProcessGroup | None = None,
        aux_loss_scale: float = 1.0,
        aux_loss_split: int = 1,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.score, self.norm_topk = cfg.moe_score, cfg.norm_topk
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False) if cfg.shared_expert_gate else None
        self.sequence_group, self.aux_loss_scale, self.aux_loss_split = sequence_group, aux_loss_scale, aux_loss_split
        self.last_aux_loss: torch.Tensor | None = None  # measured in the last training forward (detached)
        self.last_z_loss: torch.Tensor | None = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (tokens, n_experts) in fp32, top-k weights (tokens, k), top-k experts (tokens, k))."""
        logits = logits.float()
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.gate(flat)
        scores, weights, experts = self.route(logits)
        out = combine(self.experts, flat, weights.to(flat.dtype), experts, self.n_experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = out.view(b, s, -1)
        if self.training and torch.is_grad_enabled():
            # sigmoid scores are normalised per token into probabilities first, as DeepSeek-V3's balancing loss does
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = load_balancing_loss(probs.view(b, s, -1), experts.view(b, s, -1), self.n_experts, self.sequence_group)
            z = router_z_loss(logits)
            self.last_aux_loss, self.last_z_loss = aux.detach(), z.detach()
            if self.aux_loss_coef or self.z_loss_coef:
                penalty = self.aux_loss_coef * aux + self.z_loss_coef * z
                out = MoEAuxLossAutoScaler.apply(out, penalty, self.aux_loss_scale / self.aux_loss_split)
        return out


def dispatch(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) choices by expert (stably: by token within an expert). Returns the
    permutation `order` (position in the sorted rows -> flat (token, slot) index) and the rows per expert."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts)


def combine(
    grouped: GroupedExperts, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{experts[t, k]}(x[t]) for every token t, dropless: (tokens, dim)."""
    tokens, k = experts.shape
    order, counts = dispatch(experts, n_experts)
    y = grouped(x[order // k], counts)
    unsorted = torch.empty_like(y)
    unsorted[order] = y  # back to (token, slot) order: a permutation, so deterministic
    return (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Gradient scale of each micro-batch's auxiliary losses: 1/n_micro, matching the main loss's division
    by the micro-batch count (the engine sets it; data parallel's mean over replicas does the rest)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_loss_scale = scale


def set_sequence_group(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Context parallelism: every MoE layer of `model` sees one shard of each sequence, the other shards on
    the ranks of `group`; their balancing statistics are summed over it (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_group = group


def moe_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The auxiliary losses of the last training forward on this rank, averaged over its MoE layers:
    {'moe_aux_loss', 'moe_z_loss'} (detached device tensors), or {} without MoE layers or before training."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.last_aux_loss is not None]
    if not layers:
        return {}
    return {
        "moe_aux_loss": torch.stack([m.last_aux_loss for m in layers]).mean(),
        "moe_z_loss": torch.stack([m.last_z_loss for m in layers]).mean(),
    }
