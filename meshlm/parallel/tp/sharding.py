"""Megatron-style tensor parallelism, optionally with sequence parallelism, applied to a plain model by plan.

`apply_tensor_parallel` swaps the modules the model's `ParallelPlan` names (meshlm.parallel.parallel_plan) in place and
keeps every parameter name, so state dicts keep their names (HF names for meshlm's Llama):

    vocab_embedding   VocabParallelEmbedding   rows = this rank's vocabulary slice
    colwise           ColumnParallelLinear     rows (and bias) = this rank's slice of the output features
    colwise_heads     ColumnParallelLinear     the same at head boundaries; fewer heads than ranks: replicated
    FusedColwise      ColumnParallelLinear     rows = this rank's slice of every block ([q_r | k_r | v_r])
    InterleavedColwise ColumnParallelLinear    rows = this rank's whole heads of a per-head [q|k|v] layout
    rowwise           RowParallelLinear        columns = the same slice; partial outputs summed, bias added once
    vocab_head        ColumnParallelLinear     vocabulary-sharded logits (or gathered, for inference)
    sequence_parallel the module itself        under SP its parameters' gradients are summed over tp
    SplitMoE          TensorParallelMoE        each expert's hidden units split (parallel.tp_moe); output summed

A column-parallel linear opens the tensor-parallel region on its input (copy_to_tp, or an all-gather along
the sequence under SP), once per input tensor: q/k/v (or gate/up) reading one normed activation share one
collective. A row-parallel linear closes it (all-reduce, or reduce-scatter under SP); backward does the
conjugates. Every gradient is complete when backward returns — norm weights under SP and replicated KV heads
are summed inside autograd — so data parallelism / ZeRO compose without knowing.

A model built whole keeps only its slices (full-then-shard); a model built on the `meta` device is sliced as
meta tensors, and the engine then materialises only each rank's slices (meshlm.parallel.materialize), from
the same per-element init, so any tp gives the single-process initial weights either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.model.lora import LoRAError, LoRALinear, lora_delta
from meshlm.parallel.parallel_plan import (
    COLWISE,
    COLWISE_HEADS,
    FUSED_STYLES,
    ROWWISE,
    SEQUENCE_PARALLEL,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    ParallelPlan,
    SplitMoE,
    Style,
    tp_modules,
)
from meshlm.parallel.placement import Placements, Shard
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.tp.moe import TensorParallelMoE
from meshlm.parallel.tp.ops import (
    SeqShard,
    _all_reduce,
    copy_to_tp,
    gather_from_tp,
    gather_seq_for_linears,
    linear_saving_shard,
    reduce_from_tp,
    reduce_scatter_seq,
    sum_over_head_replicas,
    vocab_parallel_cross_entropy,
)
from meshlm.parallel.tp.rules import linear_pieces, moe_split_params
from meshlm.parallel.transforms.fused_loss import HeadOutput

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPState",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "gathered_logits",
    "vocab_parallel_cross_entropy",
]


# ---- modules -----------------------------------------------------------------------------------------
@dataclass
class TPState:
    """What every tensor-parallel module of one model shares (`gathered_logits` flips sequence_parallel).

    `opened` remembers the last input a column-parallel linear opened the region for, and the result (under SP
    with its sequence shard), so the linears reading the same tensor share one collective (and one saved
    shard)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    sequence_parallel: bool
    opened: tuple[torch.Tensor, torch.Tensor, SeqShard | None] | None = field(default=None, repr=False)

    def open_region(self, x: torch.Tensor) -> tuple[torch.Tensor, SeqShard | None]:
        """The region's input (under SP gathered over the sequence) and, under SP, this rank's shard of it."""
        if self.opened is None or self.opened[0] is not x:
            if self.sequence_parallel:
                self.opened = (x, *gather_seq_for_linears(x, self.group))
            else:
                self.opened = (x, copy_to_tp(x, self.group), None)
        return self.opened[1], self.opened[2]


class ColumnParallelLinear(nn.Module):
    """y[..., this rank's outputs] = x @ weight_shardᵀ (+ bias_shard), weight_shard = rows of the full weight.

    The input is the full activation on every rank (the region is opened here, once per input tensor); under
    SP the matmul saves only this rank's sequence shard of it for backward. A KV projection replicated over
    `tp // n_kv_heads` ranks passes `kv_head`: its gradient is then summed over those ranks.
    `gather_output` all-gathers the output features (full logits for inference or a loss of one's own).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        tp: TPState,
        kv_head: int | None = None,
        n_kv_heads: int | None = None,
        vocab_head: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp = tp
        self.kv_head, self.n_kv_heads = kv_head, n_kv_heads
        self.vocab_head = vocab_head
        self.gather_output = False
        self.fused_loss = (
            False  # training returns a HeadOutput for the fused loss (meshlm.parallel.transforms.fused_loss)
        )
        self.adapted = False  # LoRA: _Sharder.attach_adapter adds lora_A (replicated) and lora_B (row shard)
        self.linear = F.linear  # the local matmul (meshlm.parallel.transforms.fp8 makes it fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.kv_head is not None:
            weight = sum_over_head_replicas(weight, self.kv_head, self.n_kv_heads, self.tp.group)
            if bias is not None:
                bias = sum_over_head_replicas(bias, self.kv_head, self.n_kv_heads, self.tp.group)
        x, seq = self.tp.open_region(x)
        if self.fused_loss and self.training:
            return HeadOutput(x, weight, self.tp.group)
        if seq is None:
            y = self.linear(x, weight, bias)
        else:
            y = linear_saving_shard(x, weight, seq)
            if bias is not None:
                y = y + bias
        if self.adapted:
            lora_B = self.lora_B
            if self.kv_head is not None:
                lora_B = sum_over_head_replicas(lora_B, self.kv_head, self.n_kv_heads, self.tp.group)
            y = y + lora_delta(self, x, lora_B)
        return gather_from_tp(y, self.tp.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Partial y = x[..., this rank's inputs] @ weight_shardᵀ, summed over tp: all-reduce, or under SP a
    reduce-scatter that leaves each rank its sequence shard of the residual stream; the bias is added once,
    after the sum (under SP on the shard, so its gradient is summed over tp by a hook)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPState) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp = tp
        self.adapted = False  # LoRA: _Sharder.attach_adapter adds lora_A (column shard) and lora_B (replicated)
        self.linear = F.linear  # the local matmul (meshlm.parallel.transforms.fp8 makes it fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight)
        if self.adapted:  # the adapter's partial output joins the base's: one reduction sums both
            y = y + lora_delta(self, x)
        y = reduce_scatter_seq(y, self.tp.group) if self.tp.sequence_parallel else reduce_from_tp(y, self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank·V/tp, (rank+1)·V/tp) of the embedding: ids outside the slice give zeros, and the sum
    over tp (all-reduce, or reduce-scatter along the sequence under SP) is the full lookup."""

    def __init__(self, weight: nn.Parameter, tp: TPState, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp
        self.vocab_start = tp.rank * weight.shape[0]
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]  # whole on every rank: the rows (the vocabulary) are what is sharded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        sp = self.tp.sequence_parallel
        if sp and ids.shape[1] % self.tp.size:
            raise ValueError(f"sequence length {ids.shape[1]} is not divisible by tp={self.tp.size} under SP")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(h, self.tp.group) if sp else reduce_from_tp(h, self.tp.group)


# ---- applying it to a model --------------------------------------------------------------------------
def _shard(w: torch.Tensor, dim: int, pieces: tuple[tuple[int, int], ...], placements: Placements) -> nn.Parameter:
    """The runs `pieces` ((full start, length) along `dim`) of `w`, concatenated, as a new Parameter whose
    Shard over "tp" is recorded in `placements` (meshlm.parallel.placement). On a meta `w` (a model built on the meta
    device) the result is meta too: only its shape and record exist yet. (An explicit memory format: a
    strided meta clone would load PyTorch's Python meta kernels, ~35 MiB.)"""
    parts = [w.detach().narrow(dim, start, length) for start, length in pieces]
    piece = (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).clone(memory_format=torch.contiguous_format)
    param = nn.Parameter(piece, requires_grad=w.requires_grad)
    placements.record(param, Shard("tp", dim, pieces))
    return param


def _sum_grad_over_tp(param: nn.Parameter, tp: TPState) -> None:
    """Under SP a module run on this rank's sequence shard gets a partial gradient: sum it over tp (a frozen
    parameter has none)."""
    if param.requires_grad:
        param.register_hook(lambda grad: _all_reduce(grad, tp.group))


class _Sharder:
    """Builds each parallel module from the plain one; a Parameter shared by two modules (tied embedding
    and head) is sharded once and shared again."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, tp: TPState, placements: Placements) -> None:
        self.model, self.plan, self.tp, self.placements = model, plan, tp, placements
        self.shards: dict[int, nn.Parameter] = {}

    def shard(self, w: torch.Tensor, dim: int, pieces: tuple[tuple[int, int], ...]) -> nn.Parameter:
        key = (id(w), dim, pieces)
        if key not in self.shards:
            self.shards[key] = _shard(w, dim, pieces, self.placements)
        return self.shards[key]

    def split_rows(
        self, module: nn.Module, pieces: tuple[tuple[int, int], ...]
    ) -> tuple[nn.Parameter, nn.Parameter | None]:
        bias = getattr(module, "bias", None)
        return self.shard(module.weight, 0, pieces), None if bias is None else self.shard(bias, 0, pieces)

    def attach_adapter(self, plain: LoRALinear, parallel: nn.Module, style: str) -> None:
        """Shard a LoRA adapter with its base: under a column-parallel base (plain, fused or a KV head) A
        (rank × in) is replicated and B (out × rank) keeps exactly the base's output rows (its Shard's pieces);
        under a row-parallel base A keeps the base's input columns and B is replicated. The replicated
        factor's gradient is a partial sum on each rank (its output gradient, or its input, covers this
        rank's slice only), so it is summed over tp by a hook."""
        tp = self.tp
        if style == ROWWISE:
            cols = plain.in_features // tp.size
            lora_A = self.shard(plain.lora_A, 1, ((tp.rank * cols, cols),))
            lora_B = plain.lora_B
            _sum_grad_over_tp(lora_B, tp)
        else:
            lora_A = plain.lora_A
            _sum_grad_over_tp(lora_A, tp)
            base = self.placements[parallel.weight]
            lora_B = self.shard(plain.lora_B, 0, base.on("tp").pieces)
            if not base.counted:  # a KV head replicated over ranks: B's rows of that head, counted once
                self.placements.record(lora_B, counted=False)
        parallel.lora_A, parallel.lora_B = lora_A, lora_B
        parallel.lora_dropout, parallel.lora_scaling = plain.lora_dropout, plain.lora_scaling
        parallel.adapted = True

    def build(self, name: str, module: nn.Module, style: Style) -> nn.Module:
        parallel = self._build(name, module, style)
        if isinstance(module, LoRALinear) and parallel is not module:
            if style == VOCAB_HEAD:
                raise LoRAError("lora.targets: an adapter on the vocabulary head is not supported under tp")
            self.attach_adapter(module, parallel, style)
        return parallel

    def _build(self, name: str, module: nn.Module, style: Style) -> nn.Module:
        tp = self.tp
        if style == VOCAB_EMBEDDING:
            rows = module.num_embeddings // tp.size
            weight = self.shard(module.weight, 0, ((tp.rank * rows, rows),))
            return VocabParallelEmbedding(weight, tp, module.padding_idx)
        if isinstance(style, FUSED_STYLES) or style in (COLWISE, COLWISE_HEADS, VOCAB_HEAD):
            _, pieces = linear_pieces(self.plan, self.model, name, module, style, tp.size, tp.rank)
            weight, bias = self.split_rows(module, pieces)
            heads = None if style != COLWISE_HEADS else module.out_features // self.plan.head_dim(self.model)
            if heads is None or heads % tp.size == 0:
                return ColumnParallelLinear(weight, bias, tp, vocab_head=style == VOCAB_HEAD)
            # Fewer heads than ranks: tp/heads consecutive ranks share the head their query heads use.
            # The first of them counts its gradient for clipping and saves it, the others are replicas.
            replicas = tp.size // heads
            if tp.rank % replicas:
                for p in (weight, bias):
                    if p is not None:
                        self.placements.record(p, counted=False)
            return ColumnParallelLinear(weight, bias, tp, kv_head=tp.rank // replicas, n_kv_heads=heads)
        if style == ROWWISE:
            _, pieces = linear_pieces(self.plan, self.model, name, module, style, tp.size, tp.rank)
            weight = self.shard(module.weight, 1, pieces)
            bias = module.bias
            if bias is not None and tp.sequence_parallel:
                _sum_grad_over_tp(bias, tp)
            return RowParallelLinear(weight, bias, tp)
        if isinstance(style, SplitMoE):
            splits = [(owner, attr, dim) for _, owner, attr, dim in moe_split_params(name, module, style)]
            return TensorParallelMoE(module, tp, self.shard, splits, self.placements)
        if style == SEQUENCE_PARALLEL:
            if tp.sequence_parallel:
                for p in module.parameters(recurse=False):
                    _sum_grad_over_tp(p, tp)
            return module
        raise ValueError(f"unknown tensor-parallel style {style!r}")


@torch.no_grad()
def apply_tensor_parallel(
    model: nn.Module,
    group: dist.ProcessGroup,
    placements: Placements,
    sequence_parallel: bool = False,
    plan: ParallelPlan | None = None,
) -> TPState:
    """Keep this rank's shards of `model` (built whole from the same seed on every rank, or on the meta
    device) in place, as the model's plan (or `plan`) says, recording each one's Shard in `placements` (and
    on tp ranks > 0, what tp rank 0 counts). The plan was checked against the model before anything changed
    (meshlm.parallel.strategies.check_layout, once per build)."""
    plan = plan or plan_for(model)
    tp = TPState(group, dist.get_rank(group), dist.get_world_size(group), sequence_parallel)
    sharder = _Sharder(model, plan, tp, placements)
    for name, module, style in list(tp_modules(model, plan)):
        parallel = sharder.build(name, module, style)
        if parallel is not module:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, parallel)
    if tp.rank > 0:  # what every tp rank holds whole counts on tp rank 0 (a replicated KV head: recorded above)
        for p in model.parameters():
            if placements[p].on("tp") is None:
                placements.record(p, counted=False)
    return tp


@contextlib.contextmanager
def gathered_logits(model: nn.Module) -> Iterator[nn.Module]:
    """Inference view of a tp-sharded model: full logits on every rank and no sequence sharding (prompt
    lengths need not divide tp), so `meshlm.model.generate` runs unchanged on all ranks in lockstep."""
    heads = [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.vocab_head]
    states = {id(h.tp): h.tp for h in heads}
    saved = {key: tp.sequence_parallel for key, tp in states.items()}
    for tp in states.values():
        tp.sequence_parallel = False
    for head in heads:
        head.gather_output = True
    try:
        yield model
    finally:
        for key, tp in states.items():
            tp.sequence_parallel = saved[key]
        for head in heads:
            head.gather_output = False
