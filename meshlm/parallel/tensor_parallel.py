"""Megatron-style tensor parallelism, optionally with sequence parallelism, applied to the plain model.

`apply_tensor_parallel` swaps modules in place and keeps every parameter name, so state dicts stay HF-named:

    embed_tokens                   VocabParallelEmbedding   rows = this rank's vocab slice
    input/post_attention_layernorm TensorParallelRMSNorm    whole weight; opens the column-parallel region
    q/k/v_proj, gate/up_proj       ColumnParallelLinear     rows = this rank's heads / intermediate slice
    o_proj, down_proj              RowParallelLinear        columns = the same slice; closes the region
    model.norm, lm_head            TensorParallelRMSNorm, ColumnParallelLinear (vocab-sharded logits)

Per block the forward pass does one collective on the way into attention and the MLP (copy, or all-gather
along the sequence under SP) and one on the way out (all-reduce, or reduce-scatter under SP); backward
does the conjugates. Every gradient is complete when backward returns — the norm weights under SP and
replicated KV heads are summed inside autograd — so data parallelism / ZeRO compose without knowing.

Initialisation is full-then-shard: the caller builds the whole model from the seed and each rank keeps its
slices, so any tp gives the single-process initial weights. (For models that do not fit on one device,
build on the meta device and initialise each shard from a generator seeded per (parameter, rank) — future
work.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.model.config import ModelConfig
from meshlm.model.llama import RMSNorm, Transformer
from meshlm.parallel.mesh import check_tensor_parallel
from meshlm.parallel.tp_ops import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_for_linears,
    linear_saving_shard,
    reduce_from_tp,
    reduce_scatter_seq,
    sum_over_head_replicas,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPState",
    "TensorParallelRMSNorm",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "gathered_logits",
    "unshard_state_dict",
    "vocab_parallel_cross_entropy",
]


# ---- validation ----------------------------------------------------------------------------------------
# ---- modules -----------------------------------------------------------------------------------------
@dataclass
class TPState:
    """What every tensor-parallel module of one model shares (`gathered_logits` flips sequence_parallel)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    sequence_parallel: bool


class TensorParallelRMSNorm(RMSNorm):
    """RMSNorm that also opens the column-parallel region it feeds (attention, MLP or lm_head).

    Input: the residual stream — replicated, or this rank's sequence shard under SP. Output: the full
    sequence on every rank (copy_to_tp, or an all-gather whose shard the column linears save under SP).
    Under SP each rank's weight gradient covers only its positions, so it is summed over tp in autograd.
    """

    def __init__(self, norm: RMSNorm, tp: TPState) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sp = self.tp.sequence_parallel
        weight = copy_to_tp(self.weight, self.tp.group) if sp else self.weight
        # The same ops as RMSNorm.forward, so the result is bitwise the single-process one.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = weight * h.to(dtype)
        return gather_seq_for_linears(y, self.tp.group) if sp else copy_to_tp(y, self.tp.group)


class ColumnParallelLinear(nn.Module):
    """y[..., this rank's outputs] = x @ weight_shardᵀ with weight_shard = rows of the full weight.

    The input is already the full sequence on every rank (opened by TensorParallelRMSNorm, once for q/k/v);
    under SP the matmul saves only this rank's shard of it for backward. A KV projection replicated over
    `tp // n_kv_heads` ranks passes `kv_head`: its gradient is then summed over those ranks.
    `gather_output` (inference) all-gathers the output features.
    """

    def __init__(
        self, weight: nn.Parameter, tp: TPState, kv_head: int | None = None, n_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp
        self.kv_head, self.n_kv_heads = kv_head, n_kv_heads
        self.gather_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.kv_head is not None:
            weight = sum_over_head_replicas(weight, self.kv_head, self.n_kv_heads, self.tp.group)
        y = linear_saving_shard(x, weight)
        return gather_from_tp(y, self.tp.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Partial y = x[..., this rank's inputs] @ weight_shardᵀ, summed over tp: all-reduce, or under SP a
    reduce-scatter that leaves each rank its sequence shard of the residual stream."""

    def __init__(self, weight: nn.Parameter, tp: TPState) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return reduce_scatter_seq(y, self.tp.group) if self.tp.sequence_parallel else reduce_from_tp(y, self.tp.group)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank·V/tp, (rank+1)·V/tp) of the embedding: ids outside the slice give zeros, and the sum
    over tp (all-reduce, or reduce-scatter along the sequence under SP) is the full lookup."""

    def __init__(self, weight: nn.Parameter, tp: TPState) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp
        self.vocab_start = tp.rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        sp = self.tp.sequence_parallel
        if sp and ids.shape[1] % self.tp.size:
            raise ValueError(f"sequence length {ids.shape[1]} is not divisible by tp={self.tp.size} under SP")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(h, self.tp.group) if sp else reduce_from_tp(h, self.tp.group)


# ---- applying it to a model --------------------------------------------------------------------------
def _shard(w: torch.Tensor, dim: int, index: int, size: int) -> nn.Parameter:
    """Slice `index` (of width `size`) along `dim`, as a new Parameter tagged with its shard dim."""
    param = nn.Parameter(w.detach().narrow(dim, index * size, size).clone())
    param._meshlm_tp_shard_dim = dim  # read by engine.is_tp_replicated; None = held whole by every rank
    param._meshlm_tp_slice = (dim, index * size)  # where the slice sits in the full tensor (checkpoints)
    return param


@torch.no_grad()
def apply_tensor_parallel(model: Transformer, group: dist.ProcessGroup, sequence_parallel: bool = False) -> None:
    """Keep this rank's shards of `model` (built whole, from the same seed on every rank) in place."""
    cfg = model.cfg
    tp = TPState(group, dist.get_rank(group), dist.get_world_size(group), sequence_parallel)
    check_tensor_parallel(cfg, tp.size, seq_len=0, sequence_parallel=False)
    hd = cfg.head_dim
    q_rows = cfg.n_heads // tp.size * hd
    inter = cfg.intermediate_size // tp.size

    vocab = cfg.vocab_size // tp.size
    embedding = None
    if model.model.embed_tokens is not None:
        weight = _shard(model.model.embed_tokens.weight, 0, tp.rank, vocab)
        model.model.embed_tokens = embedding = VocabParallelEmbedding(weight, tp)

    for block in model.model.layers.values():
        attn, mlp = block.self_attn, block.mlp
        block.input_layernorm = TensorParallelRMSNorm(block.input_layernorm, tp)
        block.post_attention_layernorm = TensorParallelRMSNorm(block.post_attention_layernorm, tp)
        attn.q_proj = ColumnParallelLinear(_shard(attn.q_proj.weight, 0, tp.rank, q_rows), tp)
        if cfg.n_kv_heads % tp.size == 0:
            kv_rows = cfg.n_kv_heads // tp.size * hd
            attn.k_proj = ColumnParallelLinear(_shard(attn.k_proj.weight, 0, tp.rank, kv_rows), tp)
            attn.v_proj = ColumnParallelLinear(_shard(attn.v_proj.weight, 0, tp.rank, kv_rows), tp)
        else:
            # Fewer KV heads than ranks: tp/n_kv consecutive ranks share the KV head their query heads use.
            # The first of them counts its gradient for clipping (shard dim 0), the others are replicas.
            replicas = tp.size // cfg.n_kv_heads
            head = tp.rank // replicas
            for name in ("k_proj", "v_proj"):
                weight = _shard(getattr(attn, name).weight, 0, head, hd)
                if tp.rank % replicas:
                    weight._meshlm_tp_shard_dim = None
                setattr(attn, name, ColumnParallelLinear(weight, tp, kv_head=head, n_kv_heads=cfg.n_kv_heads))
        attn.o_proj = RowParallelLinear(_shard(attn.o_proj.weight, 1, tp.rank, q_rows), tp)
        mlp.gate_proj = ColumnParallelLinear(_shard(mlp.gate_proj.weight, 0, tp.rank, inter), tp)
        mlp.up_proj = ColumnParallelLinear(_shard(mlp.up_proj.weight, 0, tp.rank, inter), tp)
        mlp.down_proj = RowParallelLinear(_shard(mlp.down_proj.weight, 1, tp.rank, inter), tp)

    if model.model.norm is not None:
        model.model.norm = TensorParallelRMSNorm(model.model.norm, tp)
    if model.lm_head is not None:
        if cfg.tie_embeddings and embedding is not None:
            weight = embedding.weight  # one vocab-sharded Parameter for both, as in the plain model
        else:
            weight = _shard(model.lm_head.weight, 0, tp.rank, vocab)
        model.lm_head = ColumnParallelLinear(weight, tp)


@contextlib.contextmanager
def gathered_logits(model: Transformer) -> Iterator[Transformer]:
    """Inference view of a tp-sharded model: full logits on every rank and no sequence sharding (prompt
    lengths need not divide tp), so `meshlm.model.generate` runs unchanged on all ranks in lockstep."""
    tp = model.lm_head.tp
    was_sp = tp.sequence_parallel
    tp.sequence_parallel, model.lm_head.gather_output = False, True
    try:
        yield model
    finally:
        tp.sequence_parallel, model.lm_head.gather_output = was_sp, False


# ---- gathering the full model -------------------------------------------------------------------------
_DIM0 = ("q_proj.weight", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")
_DIM1 = ("o_proj.weight", "down_proj.weight")
_KV = ("k_proj.weight", "v_proj.weight")


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def unshard_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, group: dist.ProcessGroup) -> dict:
    """This rank's shards (HF names) -> the full tensors, on every tp rank. Collective: every rank of
    `group` must call it with the same names. Replicated KV heads are kept once per head."""
    size = dist.get_world_size(group)
    device = _comm_device(group)
    replicas = size // cfg.n_kv_heads if cfg.n_kv_heads < size else 1
    full = {}
    for name in sorted(state):
        t = state[name]
        if name.endswith(_DIM0 + _DIM1 + _KV):
            parts = [torch.empty_like(t, device=device) for _ in range(size)]
            dist.all_gather(parts, t.to(device).contiguous(), group=group)
            if name.endswith(_KV):
                parts = parts[::replicas]
            t = torch.cat(parts, dim=1 if name.endswith(_DIM1) else 0).to(state[name].device)
        full[name] = t
    return {name: full[name] for name in state}
