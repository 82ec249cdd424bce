"""Data parallelism and ZeRO-1/2/3 over the dp group, written directly on torch.distributed collectives.

Every stage packs parameters into flat buffers (zero.FlatBuffer) and reduces gradients buffer by buffer from
post-accumulate-grad hooks, asynchronously, so communication overlaps the rest of the backward:
  zero 0  buckets of `bucket_mb`, all-reduced; the optimizer steps the full parameters.
  zero 1  same buckets, reduce-scattered in place; each rank steps an fp32 shard, then all-gathers the weights,
          each buffer waited where the next forward first needs it (dp/gather.py).
  zero 2  the full gradient of a bucket is freed right after its reduce-scatter; only the shard is kept.
  zero 3  one unit per block (and embedding, norm+head): weights gathered before use, freed after (zero.py).
Frozen parameters (requires_grad False: a LoRA base, train.freeze) get no gradient buffer, no reduction and
no optimizer state under any stage: stages 0-2 leave them as they are (replicated, in their own dtype, e.g.
bf16); ZeRO-3 shards them too, in their own dtype (no fp32 master), gathered with their unit's trainable
buffers and never reduced (`frozen_buffers`).
Parameters are bucketed by the mesh group their placement names (`Placement.grad_group`: `group`, else one of
`grad_groups`, e.g. expert parallelism's "expert_replicas"), each reduced (and ZeRO-sharded) over it and divided
by the size of `group`, the data replicas. Under hybrid sharding another group is sharded over its ranks inside
this rank's shard block of `group` and replicated across blocks (zero.nested_shard_groups).
Inner micro-batches of gradient accumulation (set_grad_sync False) never communicate: gradients accumulate in
the full buffers and are reduced once on the last micro-batch. Under ZeRO-2/3 this keeps full gradients for
the accumulation window (reducing every micro-batch would keep only shards, for n_micro times the traffic).
A parameter that no micro-batch of any rank reducing it touched in a step (an expert without tokens) is
hidden from the optimizer (`.grad = None`), which then skips it as one process's would; under ZeRO ≥ 1 the
optimizer steps one tensor per parameter piece of the master shard so that it can (docs/zero.md).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.dp.gather import ParamGathers
from meshlm.parallel.dp.gradients import ShardedTensor, optimizer_state_keys, squared_norm_sum, unique_storage_bytes
from meshlm.parallel.dp.unused import hide_unused
from meshlm.parallel.dp.zero import (
    FlatBuffer,
    ParamSource,
    Unit,
    Zero3Hooks,
    bucket_params,
    by_grad_group,
    decays,
    direct_params,
    hybrid_shard_groups,
    nested_shard_groups,
    reduce_scatter_flat,
    split_by_kind,
)
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.parallel_plan import ParallelPlan, zero3_unit_groups
from meshlm.parallel.placement import REPLICAS, Placements
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.timers import timed_wait

# ZeRO-2/3 wait for the oldest reduction beyond this many in flight, so freed gradient buffers bound memory.
MAX_INFLIGHT_SHARDED_REDUCTIONS = 2


@dataclass
class Reduction:
    """An in-flight gradient reduction: `grad` is being summed into `out` (all of it, or this rank's shard)."""

    buffer: FlatBuffer
    work: dist.Work
    grad: torch.Tensor
    out: torch.Tensor


@dataclass(frozen=True)
class ReduceGroups:
    """Where a flat buffer's gradients are reduced and its ZeRO state is sharded: `group` holds the same
    parameters; their gradients are reduce-scattered over `shard` (None under zero 0) and all-reduced over
    `replicate` (all of the group under zero 0; the other blocks under hybrid sharding; None otherwise)."""

    group: dist.ProcessGroup
    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None

    @classmethod
    def build(cls, group: dist.ProcessGroup, zero: int, shard_group_size: int | None) -> ReduceGroups:
        return cls(group, None, group) if zero == 0 else cls(group, *hybrid_shard_groups(group, shard_group_size))

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard) if self.shard is not None else 1

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard) if self.shard is not None else 0

    @property
    def primary(self) -> bool:
        """This rank is the one replica whose (identical) reduced gradients and shards count in norms and
        checkpoints."""
        return self.replicate is None or dist.get_rank(self.replicate) == 0


class DataParallel:
    """Makes dp replicas of `chunks` train like one model: gradient averaging plus optional ZeRO sharding.

    ZeRO-3 units are the plan's `zero3_units` (default: the model's registered plan). shard_group_size enables
    hybrid sharding (HSDP): shard within consecutive blocks of that many dp ranks and
    replicate across blocks. param_dtype is the working (gathered) weight dtype, e.g. bf16, over fp32 master
    shards (zero >= 1); reduce_dtype is the dtype gradients are summed in across ranks; grad_accum_dtype the
    dtype each rank's gradients accumulate in over micro-batches before that (fp32, or bf16 to halve the
    buffer, which needs bf16 working weights: zero.FlatBuffer.full_grad). `source` initialises the
    placeholders of a meta-built model (meshlm.parallel.materialize): each rank fills only what it holds.
    `placements` (the build's table, meshlm.parallel.placement) says which mesh group reduces each gradient
    ("replicas": `group`, or one of `grad_groups`) and which weights get a flat buffer of their own.
    overlap_gather (ZeRO-1/2): the weight all-gathers after the step are each waited where the next forward first
    needs them (meshlm.parallel.dp.gather), not all at once after the step. overlap_replicate (hybrid): the
    replicate all-reduce of each reduced shard stays in flight until the backward's reductions are all issued.
    Both change when a wait happens, never the bytes: False is the benchmark's (and a suspicious user's) twin.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        group: dist.ProcessGroup,
        zero: int = 0,
        bucket_mb: float = 25.0,
        shard_group_size: int | None = None,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        grad_accum_dtype: torch.dtype = torch.float32,
        plan: ParallelPlan | None = None,
        source: ParamSource | None = None,
        grad_groups: Mapping[str, dist.ProcessGroup] | None = None,
        placements: Placements | None = None,
        overlap_gather: bool = True,
        overlap_replicate: bool = True,
    ) -> None:
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {zero}")
        self.master_dtype, param_dtype, reduce_dtype, self.grad_dtype = widened(
            chunks, param_dtype, reduce_dtype, grad_accum_dtype
        )
        if self.grad_dtype not in (self.master_dtype, param_dtype):
            raise ValueError(f"grad_accum_dtype {grad_accum_dtype} needs working weights of that dtype (zero >= 1)")
        if zero == 0 and (shard_group_size is not None or param_dtype != self.master_dtype):
            raise ValueError("hybrid sharding and param_dtype need zero >= 1 (zero 0 steps the fp32 params)")
        self.chunks = chunks
        self.plan = plan
        self.source = source
        self.placements = placements = Placements() if placements is None else placements
        self.stage = zero
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.dp_size = dist.get_world_size(group)  # the data replicas: every gradient is divided by their count
        self.dense = ReduceGroups.build(group, zero, shard_group_size)
        self.reduce_groups = self._reduce_groups(grad_groups or {})  # Placement.grad_group -> its groups
        self.shard_group, self.replicate_group = self.dense.shard, self.dense.replicate
        self.shard_size, self.shard_rank = self.dense.shard_size, self.dense.shard_rank
        self.groups_of: dict[int, ReduceGroups] = {}  # id(buffer) -> its groups
        self.across = None  # fault-tolerant replica groups (meshlm.parallel.dp.replica_groups.attach)

        self.chunk_params: list[list[nn.Parameter]] = []
        self.chunk_frozen: list[list[nn.Parameter]] = []
        self.names: dict[int, str] = {}
        for chunk in chunks:
            params, frozen = [], []
            for name, p in chunk.named_parameters():
                if id(p) not in self.names:
                    self.names[id(p)] = name
                    (params if p.requires_grad else frozen).append(p)
            self.chunk_params.append(params)
            self.chunk_frozen.append(frozen)

        self.units: list[Unit] = []
        self.chunk_buffers: list[list[FlatBuffer]] = []  # per chunk, in the order reductions are launched
        self.frozen_buffers: list[FlatBuffer] = []  # ZeRO-3: frozen parameters' shards, gathered, never reduced
        for chunk, params, frozen in zip(chunks, self.chunk_params, self.chunk_frozen, strict=True):
            if zero == 3:
                units = self._build_units(chunk, params, frozen)
                self.units += units
                self.chunk_buffers.append([buf for unit in reversed(units) for buf in unit.buffers[: unit.trainable]])
            else:
                by_group = self._by_grad_group(params)
                buckets = [(g, b) for g, ps in by_group for b in bucket_params(ps, bucket_mb * 2**20, placements)]
                self.chunk_buffers.append([self._make_buffer(b, g) for g, b in buckets])
        self.buffers = [buf for bufs in self.chunk_buffers for buf in bufs]
        self.unit_of_buffer = {id(buf): unit for unit in self.units for buf in unit.buffers}
        self._setup_stage()
        self.overlap_gather, self.overlap_replicate = overlap_gather, overlap_replicate

        self.grad_sync = [True] * len(chunks)
        self.backward_open = False  # a gradient hook fired in the backward running now
        self.synced = False  # gradients reduced for an optimizer step that zero_grad has not ended yet
        self.next_launch = [0] * len(chunks)
        self.inflight: collections.deque[Reduction] = collections.deque()
        self.replicating: list[tuple[FlatBuffer, dist.Work, torch.Tensor]] = []  # hybrid: shards being all-reduced
        for c, bufs in enumerate(self.chunk_buffers):
            for buf in bufs:
                for i, p in enumerate(buf.params):
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, c, buf, i))

    # ---- construction ---------------------------------------------------------------------------------------
    def _reduce_groups(self, grad_groups: Mapping[str, dist.ProcessGroup]) -> dict[str, ReduceGroups]:
        """The groups that reduce each gradient group's gradients: the dense ones for "replicas"; another group
        (ep's "expert_replicas") sharded as the dense shard nests in it under hybrid sharding, else as zero says."""
        out = {REPLICAS: self.dense}
        for name, other in grad_groups.items():
            if name != REPLICAS and self.dense.replicate is not None and self.dense.shard is not None:
                out[name] = ReduceGroups(other, *nested_shard_groups(other, self.dense.shard))
            elif name != REPLICAS:
                out[name] = ReduceGroups.build(other, self.stage, None)
        if missing := sorted(set(self.placements.grad_groups()) - set(out)):
            raise ValueError(f"the placements name gradient groups {missing} that grad_groups does not give")
        return out

    def _by_grad_group(self, params: list[nn.Parameter]) -> list[tuple[ReduceGroups, list[nn.Parameter]]]:
        """`params` by the mesh group that reduces their gradients (zero.by_grad_group), with its ReduceGroups."""
        return [(self.reduce_groups[name], ps) for name, ps in by_grad_group(params, self.placements).items() if ps]

    def _make_buffer(self, params: list[nn.Parameter], groups: ReduceGroups) -> FlatBuffer:
        buf = FlatBuffer(
            params, groups.shard_size, groups.shard_rank, self.param_dtype, self.source, shard_only=self.stage == 3,
            grad_dtype=self.grad_dtype,
        )  # fmt: skip
        self.groups_of[id(buf)] = groups
        return buf

    def groups(self, buf: FlatBuffer) -> ReduceGroups:
        return self.groups_of.get(id(buf), self.dense)

    def _build_units(self, chunk: nn.Module, params: list[nn.Parameter], frozen: list[nn.Parameter]) -> list[Unit]:
        """ZeRO-3 units in forward order; a parameter shared by two units (tied embeddings) joins the first.
        A unit's frozen parameters form buffers of their own, one per dtype, after its trainable ones."""
        owned = {id(p) for p in params + frozen}
        groups = zero3_unit_groups(chunk, self.plan or plan_for(chunk))
        hooked = {m for modules in groups for m in modules}
        units, unit_of_param = [], {}
        for modules in groups:
            mine = {}  # id -> param: insertion-ordered and free of duplicates
            for m in modules:
                mine.update(
                    {id(p): p for p in direct_params(m, hooked) if id(p) in owned and id(p) not in unit_of_param}
                )
            mine = list(mine.values())
            if mine:
                trainable = [p for p in mine if p.requires_grad]
                placements = self.placements
                if any(placements[p].grad_group != REPLICAS and not p.requires_grad for p in mine):
                    raise ValueError("ZeRO-3 does not support frozen parameters with a gradient group of their own")
                by_group = self._by_grad_group(trainable)
                buffers = [self._make_buffer(k, g) for g, ps in by_group for k in split_by_kind(ps, placements)]
                n_trainable = len(buffers)
                for dtype in dict.fromkeys(p.dtype for p in mine if not p.requires_grad):
                    buf = FlatBuffer(
                        [p for p in mine if not p.requires_grad and p.dtype == dtype],
                        self.shard_size, self.shard_rank, dtype, self.source, shard_only=True,
                    )  # fmt: skip
                    self.frozen_buffers.append(buf)
                    buffers.append(buf)
                groups = [self.groups(buf).shard for buf in buffers]
                unit = Unit(modules, buffers, self.shard_group, trainable=n_trainable, buffer_groups=groups)
                unit_of_param.update({id(p): unit for p in mine})
                units.append(unit)
        Zero3Hooks(units, unit_of_param)  # registers itself on the units' modules
        return units

    @torch.no_grad()
    def _setup_stage(self) -> None:
        """Start every replica from dp rank 0's weights (buffers filled from the source agree already), then
        create the masters and gradient buffers (and ZeRO-1/2's weight gathers). Frozen buffers (ZeRO-3) keep
        only their shard, in their dtype."""
        for buf in self.frozen_buffers:
            if buf.initial_shard is not None:
                buf.master, buf.initial_shard = buf.initial_shard.to(buf.data.dtype), None
            else:
                if not buf.from_source:
                    group = self.groups(buf).group
                    dist.broadcast(buf.data, src=dist.get_global_rank(group, 0), group=group)
                buf.master = buf.data[buf.shard].clone()
            buf.free_params()
        for buf in self.buffers:
            if not buf.from_source:
                group = self.groups(buf).group
                dist.broadcast(buf.data, src=dist.get_global_rank(group, 0), group=group)
            if self.stage == 0:
                buf.alloc_grad()
                buf.grad_shard = buf.full_grad
                buf.steps, buf.step_grads = buf.params, buf.views(buf.full_grad)
                buf.step_owner = list(range(len(buf.params)))
                continue
            share = self.stage < 3 and self.param_dtype == self.master_dtype
            if buf.initial_shard is not None:  # ZeRO-3 from the source: the shard is all there is
                buf.master, buf.initial_shard = buf.initial_shard, None
            else:
                shard = buf.data[buf.shard]
                buf.master = shard if share else shard.to(self.master_dtype, copy=True)
            if self.stage == 1:
                buf.alloc_grad()
            if self.stage == 1 and self.grad_dtype == self.master_dtype:  # the fp32 full gradient holds the shard
                buf.grad_shard = buf.full_grad[buf.shard]
            else:
                buf.grad_shard = torch.zeros(buf.shard_numel, dtype=self.master_dtype, device=buf.data.device)
            buf.split_master()
            if self.stage == 3:
                buf.free_params()
        self.gathers = None if self.stage not in (1, 2) else ParamGathers(
            self.chunks, self.chunk_buffers, lambda buf: self.groups(buf).shard, lambda c: self.plan or plan_for(c)
        )  # fmt: skip

    # ---- backward: reduce each buffer as soon as its gradients are complete ---------------------------------
    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        """Whether the next backward of `chunk` reduces gradients (False on inner micro-batches: no traffic)."""
        self.grad_sync[chunk] = enabled

    def _grad_ready(self, chunk: int, buf: FlatBuffer, index: int, param: nn.Parameter) -> None:
        if not self.backward_open:  # the first gradient of this backward: forget at its end which were ready
            self.backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if buf.full_grad is None:
            buf.alloc_grad()  # ZeRO-2/3: the first gradient of this buffer since its last reduction
        else:
            buf.adopt_grad(index)
        buf.used[index] = True
        buf.ready.add(index)
        if len(buf.ready) < len(buf.params):
            return
        buf.ready.clear()
        if self.stage == 3:
            self.unit_of_buffer[id(buf)].buffer_grads_ready(buf)
        if self.grad_sync[chunk]:
            buf.reduce_requested = True
            self._launch_in_order(chunk)

    def _end_of_backward(self) -> None:
        """A buffer is complete when all its parameters got their gradient in one backward: one that a
        micro-batch leaves without a gradient (an expert without tokens) must not make the next micro-batch's
        backward count as complete before its other gradients have accumulated (an early reduction, or a
        ZeRO-3 unit freed while its backward still needs the weights). Such a buffer is reduced, and its unit
        freed, when the step's backward ends (finish_grad_sync)."""
        self.backward_open = False
        for buf in self.buffers:
            buf.ready.clear()

    def _launch_in_order(self, chunk: int) -> None:
        """Launch ready buffers strictly in their fixed order, so every rank issues the same collective sequence."""
        order = self.chunk_buffers[chunk]
        while self.next_launch[chunk] < len(order) and order[self.next_launch[chunk]].reduce_requested:
            self._reduce(order[self.next_launch[chunk]])
            self.next_launch[chunk] += 1

    def _reduce(self, buf: FlatBuffer) -> None:
        if buf.full_grad is None:
            buf.alloc_grad()  # no parameter of this buffer got a gradient: its peers still need our zeros
        grad = buf.full_grad.to(self.reduce_dtype)
        groups = self.groups(buf)
        if groups.shard is None:
            out = grad
            work = dist.all_reduce(grad, group=groups.replicate, async_op=True)
        else:
            if self.stage == 1:
                out = grad[buf.shard]  # in place: the output may be the input's own slice (NCCL and gloo)
            elif grad.dtype == buf.grad_shard.dtype:
                out = buf.grad_shard
            else:
                out = grad.new_empty(buf.shard_numel)
            work = reduce_scatter_flat(out, grad, group=groups.shard, async_op=True)
        self.inflight.append(Reduction(buf, work, grad, out))
        if self.stage >= 2 and len(self.inflight) > MAX_INFLIGHT_SHARDED_REDUCTIONS:
            self._complete(self.inflight.popleft())

    def _complete(self, reduction: Reduction) -> None:
        buf, out = reduction.buffer, reduction.out
        groups = self.groups(buf)
        timed_wait(reduction.work, "all_reduce" if groups.shard is None else "reduce_scatter")
        if self.stage >= 2:
            buf.free_grad()  # `out` is a shard of its own: the full gradient is done with
        if groups.shard is not None and groups.replicate is not None:
            # hybrid: sum the shard across replicas too, in flight while the backward goes on (finish_grad_sync
            # waits for it, before anything reads the gradients)
            work = dist.all_reduce(out, group=groups.replicate, async_op=True)
            self.replicating.append((buf, work, out))
            if not self.overlap_replicate:
                self._finish_replicating()
        else:
            self._finish(buf, out)

    def _finish_replicating(self) -> None:
        """Wait for the hybrid replicate all-reduces in flight and finish their buffers."""
        for buf, work, out in self.replicating:
            timed_wait(work, "all_reduce")
            self._finish(buf, out)
        self.replicating.clear()

    def _finish(self, buf: FlatBuffer, out: torch.Tensor) -> None:
        """The reduced sum `out` of `buf`'s gradients (its shard) becomes the mean the optimizer reads."""
        if self.across is not None:  # fault-tolerant replica groups: the same shard of every live group
            self.across.sum_(out)
        out.div_(self.dp_size)  # whatever its group: each gradient sums every data replica's loss term
        if out.data_ptr() != buf.grad_shard.data_ptr():
            buf.grad_shard.copy_(out)

    def finish_grad_sync(self) -> None:
        """Reduce what the hooks did not (parameters without gradient), then wait for every reduction (and
        for the weight gathers no forward waited for: the optimizer writes the shards they read)."""
        self.settle_gathers()
        for chunk, order in enumerate(self.chunk_buffers):
            for buf in order[self.next_launch[chunk] :]:
                self._reduce(buf)
            self.next_launch[chunk] = 0
            for buf in order:
                buf.ready.clear()
                buf.reduce_requested = False
        while self.inflight:
            self._complete(self.inflight.popleft())
        self._finish_replicating()
        for unit in self.units:
            unit.end_backward()
        self._skip_unused()
        self.synced = True

    def check_not_synced(self) -> None:
        """Refuse a backward on top of gradients already reduced for an optimizer step: it would add a new
        micro-batch's local gradient to reduced (and, under ZeRO, partly sharded) sums, which no single
        process computes. Accumulation runs its inner backwards under no_sync."""
        if self.synced:
            raise RuntimeError(
                "backward after the gradients were already reduced for an optimizer step: call "
                "model.step(optimizer) (or model.zero_grad()) after each step, and accumulate under model.no_sync()"
            )

    def _skip_unused(self) -> None:
        """Hide the gradient of every parameter that no micro-batch of any rank reducing it touched this step
        (meshlm.parallel.dp.unused), after every optimizer tensor got its gradient view back, also where a loop
        of one's own called `optimizer.zero_grad()` (which sets them to None)."""
        self._point_grads()
        hide_unused(self.buffers, self.groups, self.placements, self.across)

    def _point_grads(self) -> None:
        """Make every optimizer tensor's .grad its view of the reduced gradient again (zeros where
        `_skip_unused` hid it: nothing was accumulated)."""
        for buf in self.buffers:
            for step, grad in zip(buf.steps, buf.step_grads, strict=True):
                step.grad = grad

    # ---- optimizer interface ----------------------------------------------------------------------------------
    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        """The full parameters under zero 0, else the pieces of this rank's fp32 master shards (one leaf per
        parameter piece, FlatBuffer.steps); matrices decay, vectors not."""
        if self.stage == 0:
            params = [p for ps in self.chunk_params for p in ps]
            matrices = [p for p in params if decays(p)]
            vectors = [p for p in params if not decays(p)]
        else:
            matrices = [step for buf in self.buffers if buf.decays for step in buf.steps]
            vectors = [step for buf in self.buffers if not buf.decays for step in buf.steps]
        return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]

    @torch.no_grad()
    def grad_sq_sum(self, skip: Callable[[nn.Parameter], bool]) -> torch.Tensor:
        """Sum of squared reduced gradients this rank is responsible for: its shard, on one replica only (on
        the gradients' device: no host sync)."""
        device = self.buffers[0].data.device if self.buffers else None
        total = torch.zeros((), dtype=torch.float64, device=device)
        grads = []
        for buf in self.buffers:
            if not self.groups(buf).primary:  # each buffer counts once, on the primary replica of its group
                continue
            kept = [buf.grad_shard[lo:hi] for p, _, lo, hi in buf.pieces if not skip(p)]
            grads += [buf.grad_shard] if len(kept) == len(buf.pieces) else kept  # whole shard: padding grad is 0
        return squared_norm_sum(grads, total.device)

    def grad_shards_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The reduced gradient (shard) of each of `params` that has a flat buffer of its own (pipeline-tied)."""
        ids = {id(p) for p in params}
        return [buf.grad_shard for buf in self.buffers if len(buf.params) == 1 and id(buf.params[0]) in ids]

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        shards = [buf.grad_shard for buf in self.buffers]
        if shards:
            torch._foreach_mul_(shards, coef.to(shards[0].device))

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """ZeRO-1/2: every rank updated its shard; all-gather the new weights into the model's flat buffers,
        each waited where the next forward first needs it (meshlm.parallel.dp.gather; at once without
        `overlap_gather`)."""
        if self.gathers is not None:
            self.gathers.start(self.overlap_gather)

    def settle_gathers(self) -> None:
        """Wait for every weight all-gather still in flight (ZeRO-1/2 after a step): before the fp32 shards they
        read are written or handed out, and before anything reads the flat buffers directly."""
        if self.gathers is not None:
            self.gathers.settle()

    def named_steps(self) -> list[tuple[str, nn.Parameter]]:
        """(parameter name, optimizer tensor) for every tensor the optimizer steps on this rank."""
        self.settle_gathers()
        return [
            (self.names[id(buf.params[i])], step)
            for buf in self.buffers
            for i, step in zip(buf.step_owner, buf.steps, strict=True)
        ]

    def zero_grad(self) -> None:
        """Stages 0/1 keep their full gradient buffers (param.grad are views) and zero them; 2/3 free them.
        Gradients hidden from the optimizer this step (`_skip_unused`) come back."""
        self._point_grads()
        self.synced = False
        for buf in self.buffers:
            if self.stage >= 2:
                buf.free_grad()
            else:
                buf.full_grad.zero_()
            if self.stage >= 1:
                buf.grad_shard.zero_()

    # ---- state ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def unsharded_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (from the fp32 masters when sharded) under the chunks' state_dict names."""
        self.settle_gathers()
        full: dict[int, torch.Tensor] = {}
        for buf in self.buffers + self.frozen_buffers:
            flat = buf.data if self.stage == 0 else buf.gather_master(self.groups(buf).shard)
            for p, view in zip(buf.params, buf.views(flat), strict=True):
                full[id(p)] = view.float().cpu().clone()
        state = {}
        for chunk in self.chunks:
            for name, t in chunk.state_dict(keep_vars=True).items():
                state[name] = full[id(t)] if id(t) in full else t.detach().float().cpu().clone()
        return state

    def sharded_state_dict(
        self, optimizer: torch.optim.Optimizer | None = None, replicas: str = "primary"
    ) -> dict[str, list[ShardedTensor]]:
        """This rank's pieces of the fp32 weights ('model') and, given the optimizer, of AdamW's moments
        (engine.optimizer_state_keys: AdamW's 'exp_avg', 'exp_avg_sq'), as views (no copies). Which replicas report:
          primary  the primary replica only: the union over all ranks covers every element once;
          spread   also once, the pieces spread over the replicas by size (balanced writers);
          all      every replica all its pieces (what a checkpoint load must fill).
        Tied parameters appear once, under their first name."""
        if replicas not in ("primary", "spread", "all"):
            raise ValueError(f"replicas must be 'primary', 'spread' or 'all', got {replicas!r}")
        self.settle_gathers()  # a load writes these shards, which the gathers read
        keys = ["model"] + (optimizer_state_keys(optimizer) if optimizer is not None else [])
        out: dict[str, list[ShardedTensor]] = {key: [] for key in keys}
        mine = []
        for groups in dict.fromkeys(self.groups(buf) for buf in self.buffers):  # by gradient group, "replicas" first
            if replicas == "primary" and not groups.primary:
                continue
            n_replicas, replica = 1, 0
            if replicas == "spread" and groups.replicate is not None:
                n_replicas, replica = dist.get_world_size(groups.replicate), dist.get_rank(groups.replicate)
            pieces = [(buf, i) for buf in self.buffers if self.groups(buf) == groups for i in range(len(buf.pieces))]
            load = [0] * n_replicas  # every replica computes the same greedy split: largest pieces first
            chosen = set()
            sizes = [buf.pieces[i][3] - buf.pieces[i][2] for buf, i in pieces]
            for i in sorted(range(len(pieces)), key=lambda i: -sizes[i]):
                writer = load.index(min(load))
                load[writer] += sizes[i]
                if writer == replica:
                    chosen.add(i)
            mine += [pieces[i] for i in sorted(chosen)]
        for buf, i in mine:
            p, offset, _, _ = buf.pieces[i]
            step = p if self.stage == 0 else buf.steps[i]  # zero 0: a piece is a whole parameter
            sources = {"model": step.detach().view(-1)}
            state = optimizer.state[step] if optimizer is not None else {}
            for key in keys[1:]:
                sources[key] = state[key].view(-1)
            for key, local in sources.items():
                out[key].append(ShardedTensor(self.names[id(p)], p.shape, offset, local))
        return out

    def frozen_shards(self) -> list[ShardedTensor]:
        """ZeRO-3: this rank's pieces of the frozen parameters (views of their shards), to load a base into."""
        return [
            ShardedTensor(self.names[id(p)], p.shape, offset, buf.master[lo:hi])
            for buf in self.frozen_buffers
            for p, offset, lo, hi in buf.pieces
        ]

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now in parameters (working weights + fp32 masters), gradients (full buffers and
        reduced shards) and, given the optimizer, its state (AdamW moments; the scalar step counts excluded)."""
        masters = [b.master for b in self.buffers + self.frozen_buffers if b.master is not None]
        pieces = [step for b in self.buffers if self.stage >= 1 for step in b.steps]
        params = [p for ps in self.chunk_params + self.chunk_frozen for p in ps] + masters + pieces
        grads = [p.grad for p in params if p.grad is not None]
        grads += [b.full_grad for b in self.buffers if b.full_grad is not None]  # wider than the weights: no views
        state = []
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state += [v for k, v in optimizer.state[p].items() if k != "step" and torch.is_tensor(v)]
        return {
            "params": unique_storage_bytes(params),
            "grads": unique_storage_bytes(grads),
            "optimizer": unique_storage_bytes(state),
        }


def widened(chunks: list[nn.Module], *dtypes: torch.dtype) -> tuple[torch.dtype, ...]:
    """The masters' dtype, fp32 or float64 for float64 parameters (meshlm check's runs), then `dtypes`, fp32 read
    as it: masters, shards, working weights and reductions keep float64 where the model has it."""
    wide = torch.float64 if any(p.dtype == torch.float64 for c in chunks for p in c.parameters()) else torch.float32
    return (wide, *(wide if dtype == torch.float32 else dtype for dtype in dtypes))


def replica_group(mesh: Mesh) -> dist.ProcessGroup:
    """The ranks that hold the same (whole) weights and reduce gradients together ("replicas"): dp, and under
    context parallel dp × cp (each cp rank's gradient covers only its tokens of the sequences), under expert
    parallel dp × ep × cp (the experts record "expert_replicas", dp × cp: meshlm.parallel.ep.experts)."""
    return mesh.group(REPLICAS)
