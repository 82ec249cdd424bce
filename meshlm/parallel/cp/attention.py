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
  ring     K/V blocks travel around the cp ring with explicit send/recv (batch_isend_irecv), each hop
           posted before the block in hand is computed and waited after it; each rank attends its
           queries to every block under the global causal mask through scaled_dot_product_attention's
           fused kernels (the aten flash / memory-efficient ops, which return the log-sum-exp:
           meshlm.parallel.cp.kernels; grouped key/value heads as they are) and merges the partial
           results by log-sum-exp. Backward runs the ring again through the kernels' backward ops: K/V
           travel with their gradient accumulators, which one last hop returns to their owners. Only q,
           k, v, output and log-sum-exp are saved and no block's scores are materialised, so attention
           activations per rank fall as 1/cp.
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
import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.llama import apply_rotary
from meshlm.model.moe import set_sequence_group
from meshlm.parallel.cp.kernels import block_kernel
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
class RingHop:
    """One hop of the ring in flight: `tensor` sent to the next cp rank while the previous rank's arrives.
    Posted before the block it overlaps is computed; `wait()` returns what arrived."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.sent = tensor.contiguous()  # held until the send completes
        self.received = torch.empty_like(self.sent)
        ops = [
            dist.P2POp(dist.isend, self.sent, group=group, group_peer=(rank + 1) % size),
            dist.P2POp(dist.irecv, self.received, group=group, group_peer=(rank - 1) % size),
        ]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        with comm("p2p"):
            for work in self.works:
                work.wait()
        return self.received


def ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup) -> RingHop:
    """Post one hop of the ring: send `tensor` to the next cp rank, receive the previous rank's (`wait()`)."""
    return RingHop(tensor, group)


BlockPlan = tuple[slice, slice, bool]  # query rows, key columns, whether the block is the causal diagonal


def _block_plan(q_pos: torch.Tensor, k_pos: torch.Tensor) -> BlockPlan | None:
    """Which query rows attend to which keys of one K/V block under the causal mask, from the global
    positions (host tensors, so planning never waits on the device): the smallest row and column ranges
    holding every visible pair, and whether the causal mask cuts through them (None: nothing visible). In the
    load-balanced layout a block from an earlier rank is visible to every query through its first chunk,
    one from a later rank to the second query chunk whole: half the block, unmasked, either way; the own
    block is square with increasing positions, so the mask inside it is the kernels' top-left causal one.
    Any other mask is a ValueError: the kernels run no other."""
    mask = k_pos[None, :] <= q_pos[:, None]
    rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    qs, ks = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    block = mask[qs, ks]
    if bool(block.all()):
        return qs, ks, False
    if block.shape[0] != block.shape[1] or not torch.equal(block, torch.ones_like(block).tril()):
        raise ValueError(
            f"ring attention: a block's causal mask is not top-left triangular (positions {q_pos.tolist()} against "
            f"{k_pos.tolist()}); valid: each rank's positions increasing, as chunk_positions"
        )
    return qs, ks, True


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's output and log-sum-exp into the running (at least fp32) ones, in place. Every row a
    block touches sees at least one of its keys, so the block's log-sum-exp is finite."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    """Each step posts the next hop of the K/V ring, runs the block it holds through the fused kernel
    (meshlm.parallel.cp.kernels), then waits for the hop. Backward does the same with the K/V blocks and
    sends each block's gradient accumulator after it, so that hop overlaps the next block's kernel; the
    last one brings each block's sum home."""

    @staticmethod
    def forward(ctx, q, k, v, plans, group, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        kernel = block_kernel(q, k, v)
        wide = torch.promote_types(q.dtype, torch.float32)  # the merge's statistics and accumulator
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            src = (rank - step) % size
            hop = ring_shift(kv, group) if step < size - 1 else None
            if plans[src] is not None:
                qs, ks, causal = plans[src]
                block_out, block_lse = kernel.forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, scale)
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if hop is not None:
                kv = hop.wait()
        out = out.to(q.dtype)  # saved as returned: no second, wider copy
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.group, ctx.scale, ctx.kernel = plans, group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plans, group, scale, kernel = ctx.plans, ctx.group, ctx.scale, ctx.kernel
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        wide = torch.promote_types(q.dtype, torch.float32)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)  # travels with the block it is for
        dkv_hop = None
        block = 0  # the kernel's own count of the blocks it ran forward
        for step in range(size):
            src = (rank - step) % size
            hop = ring_shift(kv, group) if step < size - 1 else None
            grads = None
            if plans[src] is not None:
                qs, ks, causal = plans[src]
                grads = kernel.backward(block, grad_out[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                        out[:, :, qs], lse[:, :, qs], causal, scale)  # fmt: skip
                block += 1
                dq[:, :, qs] += grads[0]
            if dkv_hop is not None:
                dkv = dkv_hop.wait()
            if grads is not None:
                dkv[0][:, :, ks] += grads[1]
                dkv[1][:, :, ks] += grads[2]
            dkv_hop = ring_shift(dkv, group)  # after the last step this hop brings each block's sum home
            if hop is not None:
                kv = hop.wait()
        dkv = dkv_hop.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks (b, h, seq/cp, d; k/v may have fewer heads)
    over the whole sequence, the K/V blocks passed around the `group` ring. Only the visible part of each
    block is computed (`_block_plan`): the own block causal, each other block's visible half unmasked,
    so every rank does the same work, each block through a fused SDPA kernel (`block_kernel`)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, _ring_plans(q.shape[2] * size, size, rank), group, scale)


@functools.lru_cache(maxsize=64)
def _ring_plans(seq: int, size: int, rank: int) -> tuple[BlockPlan | None, ...]:
    """`_block_plan` of each source rank's block for this rank, planned once per sequence length (the masks
    it reads are seq/cp squared: every layer of every step would otherwise rebuild them on the host)."""
    positions = [chunk_positions(seq, size, r) for r in range(size)]
    return tuple(_block_plan(positions[rank], positions[src]) for src in range(size))


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
