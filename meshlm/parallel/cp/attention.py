"""Context parallelism: each rank of the `cp` group holds part of every sequence, applied to a plain model.

Layout (causal load balancing): a sequence of S tokens is cut into 2·cp chunks of S/(2·cp) and cp rank r
holds chunks r and 2·cp−1−r, so every rank has as many early (cheap) as late (expensive) query rows
under the causal mask. The engine hands each rank these columns of its batch (`shard_sequence`) and the
attention core rotates q/k by the same global positions (`chunk_positions`).

Two attention cores replace the model's. The plan names where: its `context_parallel` pattern names
modules whose `core` attribute (meshlm.model.llama.causal_attention's signature: rotary inside) is swapped;
its `attention` pattern names a model's own attention-core modules, `forward(q, k, v) -> out` on
(batch, heads, seq, head_dim) tensors, causal, positions already applied, which are replaced whole
(`ContextParallelCore`). Its `positions` pattern names modules called with the local positions
0..n-1 of the rank's n tokens (a learned position embedding fed `torch.arange(n)`): under cp a forward
pre-hook hands them the tokens' global positions instead.
  ring     K/V blocks travel around the cp ring with explicit send/recv (batch_isend_irecv); each rank
           attends its queries to every block under the global causal mask and merges the partial
           results by log-sum-exp. Backward runs the ring again: K/V travel with their gradient
           accumulators, which one last hop returns to their owners. Only q, k, v, output and
           log-sum-exp are saved, so attention activations per rank fall as 1/cp.
  ulysses  an all-to-all trades the sequence shard for cp-th of the heads: each rank runs ordinary causal
           attention over the whole sequence for its heads, then the inverse all-to-all (its own
           backward) restores the sequence shard. Needs heads (query and key/value) divisible by cp.

Everything outside attention is per token, so it runs unchanged on the local tokens; the loss of each cp
rank is the mean over its (equally many) tokens, and cp ranks reduce gradients and losses together with
dp (the flattened "replicas" group, meshlm.parallel.mesh.build_mesh), which makes the mean over ranks the
global-token mean. The one per-sequence quantity, the mixture-of-experts balancing loss, sums its statistics
over the cp group (meshlm.model.moe.set_sequence_group).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.llama import apply_rotary
from meshlm.model.moe import set_sequence_group
from meshlm.parallel.parallel_plan import ParallelPlan, PlanError
from meshlm.parallel.timers import comm

__all__ = [
    "ContextParallelAttention",
    "ContextParallelCore",
    "apply_context_parallel",
    "check_cp_plan",
    "chunk_positions",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
]


# ---- the load-balanced layout -------------------------------------------------------------------------
def chunk_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions cp rank `rank` holds of a `seq_len` sequence: chunks rank and 2·cp−1−rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def shard_sequence(batch: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's columns (batch, seq) -> (batch, seq/cp) of a token batch, in `chunk_positions` order."""
    if cp == 1:
        return batch
    return batch[:, chunk_positions(batch.shape[1], cp, rank, batch.device)]


# ---- ring attention --------------------------------------------------------------------------------------
def ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `tensor` to the next cp rank and return the one the previous rank sent (one hop of the ring)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size),
    ]
    with comm("p2p"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


BlockPlan = tuple[slice, slice, bool]  # query rows, key columns, whether the causal mask cuts through them


def _block_plan(q_pos: torch.Tensor, k_pos: torch.Tensor) -> BlockPlan | None:
    """Which query rows attend to which keys of one K/V block under the causal mask, from the global
    positions (host tensors, so planning never waits on the device): the smallest row and column ranges
    holding every visible pair, and whether the mask is needed inside them (None: nothing visible). In the
    load-balanced layout a block from an earlier rank is visible to every query through its first chunk,
    one from a later rank to the second query chunk whole: half the block, unmasked, either way."""
    mask = k_pos[None, :] <= q_pos[:, None]
    rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    qs, ks = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    return qs, ks, not bool(mask[qs, ks].all())


def _scores(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, masked: bool, scale: float
) -> torch.Tensor:
    """Scores (b, h, sq, sk), at least fp32, of query rows against one block's keys, masked by global
    position where `masked` (the mask is built here, never stored); key/value heads are repeated to the
    query heads (grouped-query attention)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")) if masked else s


def _acc(t: torch.Tensor) -> torch.Tensor:
    """At least fp32: the softmax statistics and the accumulators of a bf16 run stay in fp32."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s − lse), with rows that see no key (lse = −inf) giving zeros instead of NaN."""
    return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))


def _fold_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over repeated key/value heads (b, h, s, d) summed back to (b, kv_heads, s, d)."""
    b, h, s, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, plans, group, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros_like(_acc(q))
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            src = (rank - step) % size
            if plans[src] is not None:
                qs, ks, masked = plans[src]
                s = _scores(q[:, :, qs], kv[0][:, :, ks], positions[rank][qs], positions[src][ks], masked, scale)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(_probs(s, block_lse), _acc(kv[1][:, :, ks].repeat_interleave(rep, 1)))
                old = lse[:, :, qs]
                new = torch.logaddexp(old, block_lse)
                safe = torch.where(torch.isinf(new), 0.0, new)
                out[:, :, qs] = out[:, :, qs] * torch.exp(old - safe).unsqueeze(-1) + block_out * torch.exp(
                    block_lse - safe
                ).unsqueeze(-1)
                lse[:, :, qs] = new
            if step < size - 1:
                kv = ring_shift(kv, group)
        out = out.to(q.dtype)  # saved as returned: no second, wider copy
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.plans, ctx.group, ctx.scale = positions, plans, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        positions, plans, group, scale = ctx.positions, ctx.plans, ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        rep = q.shape[1] // k.shape[1]
        do = _acc(grad_out)
        delta = (do * _acc(out)).sum(-1, keepdim=True)
        dq = torch.zeros_like(do)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=do.dtype, device=q.device)  # travels with the block it is for
        for step in range(size):
            src = (rank - step) % size
            if plans[src] is not None:
                qs, ks, masked = plans[src]
                qb, dob = q[:, :, qs], do[:, :, qs]
                s = _scores(qb, kv[0][:, :, ks], positions[rank][qs], positions[src][ks], masked, scale)
                p = _probs(s, lse[:, :, qs])
                dv = torch.matmul(p.transpose(-1, -2), dob)
                dp = torch.matmul(dob, _acc(kv[1][:, :, ks].repeat_interleave(rep, 1)).transpose(-1, -2))
                ds = p * (dp - delta[:, :, qs])
                dq[:, :, qs] += torch.matmul(ds, _acc(kv[0][:, :, ks].repeat_interleave(rep, 1))) * scale
                dk = torch.matmul(ds.transpose(-1, -2), _acc(qb)) * scale
                dkv[0][:, :, ks] += _fold_heads(dk, k.shape[1])
                dkv[1][:, :, ks] += _fold_heads(dv, k.shape[1])
            if step < size - 1:
                kv = ring_shift(kv, group)
            dkv = ring_shift(dkv, group)  # after the last step this hop brings each block's sum home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks (b, h, seq/cp, d; k/v may have fewer heads)
    over the whole sequence, the K/V blocks passed around the `group` ring. Only the visible part of each
    block is computed (`_block_plan`): the own block masked, each other block's visible half unmasked,
    so every rank does the same work."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seq = q.shape[2] * size
    positions = torch.stack([chunk_positions(seq, size, r) for r in range(size)])
    plans = [_block_plan(positions[rank], positions[src]) for src in range(size)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, positions.to(q.device), plans, group, scale)


# ---- Ulysses (all-to-all) --------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single over the leading dimension (one slice per rank)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with comm("all_to_all"):
        dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, h, s/cp, d) sequence shard -> (b, h/cp, s, d) head shard, the sequence in rank order."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = _all_to_all(x.view(b, size, h // size, s, d).transpose(0, 1), group)  # [j] = rank j's tokens
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of _seq_to_heads."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = _all_to_all(x.view(b, h, size, s // size, d).permute(2, 0, 1, 3, 4), group)  # [j] = head group j
    return parts.transpose(0, 1).reshape(b, size * h, s // size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks by all-to-all: heads split over `group`, the
    whole sequence (put back in position order) attended per head, then the sequence shard restored."""
    size = dist.get_world_size(group)
    if q.shape[1] % size or k.shape[1] % size:
        raise ValueError(f"ulysses: {q.shape[1]} query / {k.shape[1]} key-value heads do not split over cp={size}")
    seq = q.shape[2] * size
    order = torch.cat([chunk_positions(seq, size, r, q.device) for r in range(size)])  # token at each slot
    slot = torch.empty_like(order)
    slot[order] = torch.arange(seq, device=q.device)  # slot of each position
    q, k, v = (_SeqToHeads.apply(t, group).index_select(2, slot) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return _HeadsToSeq.apply(out.index_select(2, order), group)


# ---- the core and the transform --------------------------------------------------------------------------
class ContextParallelAttention:
    """The attention core (meshlm.model.llama.causal_attention's signature) on this rank's chunks: rotary
    by the chunks' global positions, then ring or Ulysses attention over the cp group."""

    def __init__(self, group: dist.ProcessGroup, attention: str = "ring") -> None:
        if attention not in ("ring", "ulysses"):
            raise ValueError(f"parallel.cp_attention = {attention!r}; valid: 'ring', 'ulysses'")
        self.group, self.attention = group, attention
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._tables: tuple | None = None

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return chunk_positions(local_len * self.size, self.size, self.rank, device)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, local_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' rows of the tables, gathered once and shared by every layer (like the single-process
        core's slices of the model's tables), so they are saved for backward once, not per layer."""
        key = (local_len, cos.data_ptr(), sin.data_ptr(), cos.dtype)
        if self._tables is None or self._tables[0] != key:
            pos = self.positions(local_len, cos.device)
            self._tables = (key, cos[pos], sin[pos])
        return self._tables[1], self._tables[2]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        seq = q.shape[2] * self.size
        if seq > cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len {cos.shape[0]}")
        cos, sin = self.rotary(cos, sin, q.shape[2])
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attend = ring_attention if self.attention == "ring" else ulysses_attention
        return attend(q, k, v, self.group)


class ContextParallelCore(nn.Module):
    """A model's own attention core under cp: (q, k, v) (batch, heads, seq/cp, head_dim) of this rank's
    chunks, positions already applied, -> causal attention over the whole sequence, by ring or Ulysses."""

    def __init__(self, group: dist.ProcessGroup, attention: str = "ring") -> None:
        super().__init__()
        if attention not in ("ring", "ulysses"):
            raise ValueError(f"parallel.cp_attention = {attention!r}; valid: 'ring', 'ulysses'")
        self.group, self.attention = group, attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attend = ring_attention if self.attention == "ring" else ulysses_attention
        return attend(q, k, v, self.group)


def _global_positions(cp: int, rank: int) -> Callable[[nn.Module, tuple], tuple]:
    """A forward pre-hook mapping the local positions 0..n-1 (first argument) to the tokens' global ones."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        local = args[0]
        table = chunk_positions(local.shape[-1] * cp, cp, rank, local.device)
        return (table[local], *args[1:])

    return hook


def check_cp_plan(model: nn.Module, plan: ParallelPlan) -> None:
    """A one-line PlanError if cp cannot be applied to `model` by `plan`: no pattern, a pattern matching no
    module, a `context_parallel` module without a callable `core`, an `attention` module with parameters."""
    cls = type(model).__name__
    if not (plan.context_parallel or plan.attention):
        raise PlanError(
            f"plan {plan.name!r} for {cls} has no context_parallel pattern and no attention pattern; cp > 1 needs "
            "ParallelPlan.attention (modules whose forward is (q, k, v) -> out) or context_parallel (a `core`)"
        )
    for field, pattern in (("context_parallel", plan.context_parallel), ("attention", plan.attention),
                           ("positions", plan.positions)):  # fmt: skip
        if pattern and not _matching(model, pattern):
            raise PlanError(f"plan {plan.name!r}: {field} {pattern!r} matches no module of {cls}")
    for name, module in _matching(model, plan.context_parallel) if plan.context_parallel else ():
        if not callable(getattr(module, "core", None)):
            raise PlanError(f"plan {plan.name!r}: {name} ({type(module).__name__}) has no replaceable `core`")
    for name, module in _matching(model, plan.attention) if plan.attention else ():
        if any(True for _ in module.parameters()):
            raise PlanError(
                f"plan {plan.name!r}: attention module {name} ({type(module).__name__}) has parameters; name the "
                "parameter-free core whose forward is (q, k, v) -> out"
            )


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]


def apply_context_parallel(
    model: nn.Module, plan: ParallelPlan, group: dist.ProcessGroup, attention: str = "ring"
) -> int:
    """Swap the `core` of every module the plan's `context_parallel` pattern names, replace every module its
    `attention` pattern names by a ContextParallelCore, hook its `positions` modules and give its MoE layers
    the group (set_sequence_group); return how many attention modules changed. Checked first (check_cp_plan):
    a refusal changes nothing."""
    check_cp_plan(model, plan)
    matched = _matching(model, plan.context_parallel) if plan.context_parallel else []
    if matched:
        core = ContextParallelAttention(group, attention)
        for _, module in matched:
            module.core = core
    cores = _matching(model, plan.attention) if plan.attention else []
    for name, _ in cores:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, ContextParallelCore(group, attention))
    for _, module in _matching(model, plan.positions) if plan.positions else ():
        module.register_forward_pre_hook(_global_positions(dist.get_world_size(group), dist.get_rank(group)))
    set_sequence_group(model, group)  # MoE layers: balancing statistics over the whole sequences
    return len(matched) + len(cores)
