"""ZeRO building blocks: flat sharded buffers, hybrid-sharding process groups, and ZeRO-3 units with their hooks.

A FlatBuffer lays parameters of one kind (matrices, which decay, or vectors, which do not) end to end in one
tensor padded to a multiple of the shard-group size S, so rank r of the shard group owns the contiguous shard
[r·n/S, (r+1)·n/S): its optimizer state, its reduced gradient and, under ZeRO-3, its only copy of the weights.
Model parameters become views into the flat tensor (`param.data = view`), so the model code never changes and
a whole buffer moves in one collective. While ZeRO-3 has freed a buffer's gathered weights, its parameters are
FreedParameters: reading one raises FreedParameterError instead of reading freed memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from types import GetSetDescriptorType
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.placement import REPLICAS, Placements
from meshlm.parallel.timers import timed_wait
from meshlm.parallel.transforms.fused_loss import HeadOutput

# torch 2.13 renamed the flat collectives; fall back to the older names (same semantics) on earlier versions.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FreedParameterError(RuntimeError):
    """A ZeRO-3 parameter's values were read while its unit's gathered weights are freed."""


# Properties whose value is a view of the tensor's elements; every other property describes the tensor.
_VALUE_VIEWS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag", "_base"})
# Methods that describe a parameter or hook into autograd without reading its elements.
_DESCRIBES: frozenset[Callable] = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.__len__,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.element_size,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.data_ptr,
        torch.Tensor.untyped_storage,
        torch.Tensor.requires_grad_,
        torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.is_floating_point,
        torch.is_complex,
        torch.empty_like,
        torch.zeros_like,
        torch.ones_like,
        torch.autograd.backward,  # the saved parameters' backward gathers them first (Zero3Hooks)
        torch.autograd.grad,
    }
)


def _describes(func: Callable) -> bool:
    """Whether a torch function on a parameter leaves its elements unread: a property other than a view of
    them (a property's getter and setter are bound to its descriptor), or one of _DESCRIBES."""
    prop = getattr(func, "__self__", None)
    if isinstance(prop, GetSetDescriptorType):
        return prop.__name__ not in _VALUE_VIEWS
    return func in _DESCRIBES


class FreedParameter(nn.Parameter):
    """What a ZeRO-3 parameter is while its unit's gathered weights are freed (FlatBuffer.free_params): the
    same object, shape, dtype, requires_grad and hooks, but its storage holds no bytes, so any operation that
    would read its values raises FreedParameterError (a read of freed memory could crash the process or return
    garbage). What describes it (shape, dtype, device, grad, numel, ...) still works. The next gather makes it
    a plain Parameter again (FlatBuffer.alloc_params)."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        if _describes(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        prop = getattr(func, "__self__", None)
        name = prop.__name__ if isinstance(prop, GetSetDescriptorType) else func.__name__
        raise FreedParameterError(
            f"a ZeRO-3 parameter was read ({name}) while its unit's gathered weights are freed (they exist from "
            "the unit's gather to the end of its forward, and again for its backward); read the weights with "
            "model.full_state_dict() (gathered from the shards) or model.named_optimizer_tensors() (this rank's "
            "fp32 shards)"
        )


def resident(param: torch.Tensor) -> bool:
    """Whether this rank holds `param`'s values now (not a ZeRO-3 parameter whose gathered weights are freed)."""
    return not isinstance(param, FreedParameter)


def decays(param: nn.Parameter) -> bool:
    """AdamW weight decay applies to matrices (embeddings, projections), never to vectors (norm weights)."""
    return param.ndim >= 2


class ParamSource(Protocol):
    """Initial values of parameters not materialised yet (meshlm.parallel.materialize.MetaInit)."""

    pending: dict[int, str]

    def fill(self, param: torch.Tensor, out: torch.Tensor, start: int = 0) -> None: ...

    def done(self, param: nn.Parameter) -> None: ...


class FlatBuffer:
    """Same-kind parameters in one padded flat tensor, plus the gradient and optimizer views ZeRO needs.

    full_grad:  the whole flat gradient in `grad_dtype`, where this rank's micro-batch gradients accumulate;
                ZeRO-2/3 free it after each reduction. In the working dtype param.grad are views of it; wider
                (fp32 under bf16 working weights: parallel.grad_accum_dtype) each backward's param.grad, which
                autograd computes in the working dtype, is added into it in fp32 and released (`adopt_grad`),
                as FSDP2 upcasts to its reduce dtype and Megatron accumulates into main_grad.
    grad_shard: this rank's reduced fp32 gradient shard (all of full_grad for zero 0).
    master:     this rank's fp32 shard (ZeRO ≥ 1); a view of `data` when the working params are fp32 and not
                sharded (ZeRO-1/2), so fp32 runs hold no second copy.
    steps:      what the optimizer steps, one tensor per parameter (zero 0: the parameters; ZeRO ≥ 1: one leaf
                per piece of this rank's shard, a view of `master` whose .grad is a view of `grad_shard`), so
                a parameter that got no gradient can be skipped as one process's optimizer skips it.
    step_grads: each of `steps`' gradient view; step_owner: the index in `params` each belongs to.
    used:       which params got a gradient since the last optimizer step (post-accumulate-grad hooks).

    Parameters pending in `source` (placeholders of a meta-built model) are filled from it straight into the
    buffer, in its dtype. When all are and `shard_only` (ZeRO-3), only this rank's shard is filled, into
    `initial_shard` (fp32, rounded through the working dtype as a copy of the buffer would be), and the full
    weights are not allocated until the first gather.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        shard_size: int,
        shard_rank: int,
        dtype: torch.dtype,
        source: ParamSource | None = None,
        shard_only: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = params
        self.grad_dtype = grad_dtype or dtype
        self.kinds = [type(p) for p in params]  # their classes, which a gather gives back after free_params
        self.decays = decays(params[0])
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets.pop()
        self.padded_numel = math.ceil(self.numel / shard_size) * shard_size
        self.shard_numel = self.padded_numel // shard_size
        self.shard = slice(shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel)
        pending = [source is not None and id(p) in source.pending for p in params]
        self.from_source = all(pending)  # then every replica computes the same values: no broadcast needed
        lazy = self.from_source and shard_only
        # The lazy buffer only lends its views (freed at once): untouched pages of a fresh host allocation cost
        # no resident memory, and on CUDA the caching allocator keeps the block for the first gather.
        self.data = torch.empty(self.padded_numel, dtype=dtype, device=params[0].device)
        with torch.no_grad():
            for p, view, from_source in zip(params, self.views(self.data), pending, strict=True):
                if from_source and not lazy:
                    source.fill(p, view.view(-1))
                elif not lazy:
                    view.copy_(p.detach())
                p.data = view
            if not lazy:
                self.data[self.numel :].zero_()
        self.pieces = self._shard_pieces()
        self.initial_shard: torch.Tensor | None = None
        if lazy:
            self.free_params()
            self.initial_shard = self._shard_from(source, dtype)
        for p, from_source in zip(params, pending, strict=True):
            if from_source:
                source.done(p)
        self.full_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.steps: list[nn.Parameter] = []
        self.step_grads: list[torch.Tensor] = []
        self.step_owner: list[int] = []
        self.used = [False] * len(params)
        self.ready: set[int] = set()  # indices of params whose gradient is complete in this backward
        self.reduce_requested = False

    @torch.no_grad()
    def _shard_from(self, source: ParamSource, dtype: torch.dtype) -> torch.Tensor:
        """This rank's fp32 shard of the initial weights, padding zero, each piece from `source`."""
        shard = torch.zeros(self.shard_numel, dtype=torch.promote_types(dtype, torch.float32), device=self.data.device)
        for p, offset, lo, hi in self.pieces:
            source.fill(p, shard[lo:hi], offset)
        if dtype != shard.dtype:
            for part in shard.split(1 << 20):  # the rounding a copy into the working buffer would do
                part.copy_(part.to(dtype))
        return shard

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat tensor laid out like this buffer, shaped like the parameter."""
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params, strict=True)]

    def _shard_pieces(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """(param, offset into the flattened param, start, end within this rank's shard) for each overlap."""
        pieces = []
        for p, start in zip(self.params, self.offsets, strict=True):
            lo, hi = max(start, self.shard.start), min(start + p.numel(), self.shard.stop)
            if lo < hi:
                pieces.append((p, lo - start, lo - self.shard.start, hi - self.shard.start))
        return pieces

    def split_master(self) -> None:
        """ZeRO ≥ 1: one leaf parameter per piece of this rank's shard, sharing the master's storage, its
        gradient the piece's view of grad_shard: the optimizer's per-tensor state and skips then match one
        process's, parameter by parameter (FSDP2 does the same with its sharded parameters)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        master = self.master.detach()
        self.steps = [nn.Parameter(master[lo:hi]) for _, _, lo, hi in self.pieces]
        self.step_grads = [self.grad_shard[lo:hi] for _, _, lo, hi in self.pieces]
        self.step_owner = [index[id(p)] for p, _, _, _ in self.pieces]
        for piece, grad in zip(self.steps, self.step_grads, strict=True):
            piece.grad = grad

    @property
    def grad_views(self) -> bool:
        """Whether param.grad are views of full_grad (it is in the working dtype), else added into it."""
        return self.grad_dtype == self.data.dtype

    def alloc_grad(self) -> None:
        """Allocate the flat gradient and make every param.grad a view of it, keeping grads already computed;
        wider than the working dtype, the grads already computed are added into it and released."""
        self.full_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.data.device)
        for p, view in zip(self.params, self.views(self.full_grad), strict=True):
            if not self.grad_views:
                if p.grad is not None:
                    view.add_(p.grad)
                    p.grad = None
                continue
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    def adopt_grad(self, index: int) -> None:
        """Make params[index].grad its view of full_grad again where something replaced it: a loop of one's
        own calling `optimizer.zero_grad()` (zero 0) or a module's `zero_grad()` sets it to None, and autograd
        then accumulates this step's gradient into a fresh tensor, which the reduction would never see.
        Wider than the working dtype, full_grad adds this backward's param.grad (released: the next backward's
        starts afresh, so each micro-batch's gradient is rounded to the working dtype once, never the sum)."""
        p = self.params[index]
        offset = self.offsets[index]
        if not self.grad_views:
            self.full_grad[offset : offset + p.numel()].view(p.shape).add_(p.grad)
            p.grad = None
            return
        if p.grad.data_ptr() != self.full_grad.data_ptr() + offset * self.full_grad.element_size():
            view = self.full_grad[offset : offset + p.numel()].view(p.shape)
            view.copy_(p.grad)
            p.grad = view

    def free_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.full_grad = None

    def free_params(self) -> None:
        """Release the gathered weights; params keep their shapes and become FreedParameters, whose values
        cannot be read, until the next gather gives their storage back."""
        self.data.untyped_storage().resize_(0)
        for p in self.params:
            p.__class__ = FreedParameter

    def alloc_params(self) -> None:
        """Re-allocate the full weights (uninitialised) and make the params their plain classes again."""
        self.data.untyped_storage().resize_(self.padded_numel * self.data.element_size())
        for p, kind in zip(self.params, self.kinds, strict=True):
            p.__class__ = kind

    def start_gather(self, group: dist.ProcessGroup | None) -> tuple[dist.Work, torch.Tensor]:
        """Re-allocate the full weights and all-gather them from every rank's master shard (async)."""
        self.alloc_params()
        src = self.master.detach().to(self.data.dtype)
        return all_gather_flat(self.data, src, group=group, async_op=True), src

    def gather_master(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The full fp32 flat weights, gathered from the master shards (for export, not for training)."""
        full = torch.empty(self.padded_numel, dtype=torch.float32, device=self.data.device)
        all_gather_flat(full, self.master.detach().float(), group=group)
        return full


def hybrid_shard_groups(
    dp_group: dist.ProcessGroup, shard_size: int | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group) for this rank: shard over consecutive blocks of `shard_size` dp ranks
    (e.g. one node, fast links), replicate across blocks. Without hybrid sharding: (dp group, None).

    Every rank of the world must call this together: it creates the sub-groups of every dp group in one order.
    """
    dp_ranks = dist.get_process_group_ranks(dp_group)
    dp = len(dp_ranks)
    if shard_size is None or shard_size == dp:
        return dp_group, None
    if shard_size < 1 or dp % shard_size:
        raise ValueError(f"ZeRO shard group size {shard_size} must divide the data-parallel size {dp}")
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_ranks)
    dp_groups = sorted({tuple(ranks) for ranks in every})
    shard_lists = [list(g[i : i + shard_size]) for g in dp_groups for i in range(0, dp, shard_size)]
    replicate_lists = [list(g[j::shard_size]) for g in dp_groups for j in range(shard_size)]
    shard_group, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicate_lists)
    return shard_group, replicate_group


def nested_shard_groups(
    group: dist.ProcessGroup, block: dist.ProcessGroup
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group) of parameters held by the ranks of `group` (expert parallel: the
    expert-data group, dp × cp) under hybrid sharding, whose shard blocks are `block` (this rank's shard
    group of the dense weights): shard over the ranks of `group` inside this rank's block, replicate across
    blocks, so their gathers stay inside a block like the dense weights'. Without a replica outside the block:
    (group, None).

    Every rank of the world must call this together: it creates the sub-groups of every group in one order.
    """
    every: list[tuple | None] = [None] * dist.get_world_size()
    mine = (tuple(dist.get_process_group_ranks(group)), tuple(sorted(dist.get_process_group_ranks(block))))
    dist.all_gather_object(every, mine)
    shard_lists, replicate_lists = nested_shard_lists([g for g, _ in every], [b for _, b in every])
    if not replicate_lists:
        return group, None
    shard_group, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicate_lists)
    return shard_group, replicate_group


def nested_shard_lists(
    groups: list[tuple[int, ...]], blocks: list[tuple[int, ...]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The rank lists of nested_shard_groups, from every rank's group and shard block: each group cut by the
    blocks into equal parts (the shard lists), and the replicate lists (the j-th rank of every part of a
    group); no replicate lists when each group lies inside one block. A one-line ValueError if the blocks cut
    a group into unequal parts."""
    groups, blocks = sorted(set(groups)), sorted(set(blocks))
    split = [[[r for r in g if r in b] for b in blocks if set(g) & set(b)] for g in groups]
    sizes = {len(part) for parts in split for part in parts}
    if len(sizes) > 1:
        raise ValueError(
            f"parallel.zero_shard_size ({len(blocks[0])}) cuts the ranks that hold the same experts "
            f"({len(groups[0])}: dp×cp) into unequal parts {sorted(sizes)}; use a shard size that divides cp, "
            "or a multiple of ep×cp"
        )
    size = sizes.pop()
    if size == len(groups[0]):
        return [list(g) for g in groups], []
    shard_lists = [part for parts in split for part in parts]
    return shard_lists, [[part[j] for part in parts] for parts in split for j in range(size)]


def direct_params(module: nn.Module, hooked: set[nn.Module]) -> list[nn.Parameter]:
    """Parameters reachable from `module` without entering another unit's module."""
    params, stack = [], [module]
    while stack:
        m = stack.pop()
        params += list(m.parameters(recurse=False))
        stack += [c for c in m.children() if c not in hooked]
    return params


class Unit:
    """One ZeRO-3 unit: its flat buffers are gathered together before use and freed together after."""

    def __init__(
        self,
        modules: list[nn.Module],
        buffers: list[FlatBuffer],
        group: dist.ProcessGroup | None,
        trainable: int | None = None,
        buffer_groups: list[dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.modules = modules
        self.buffers = buffers
        self.trainable = len(buffers) if trainable is None else trainable  # buffers whose gradients end backward
        self.group = group
        # each buffer's shard group (expert shards: their own, under expert parallelism); `group` by default
        self.buffer_groups = buffer_groups or [group] * len(buffers)
        self.gathered = False
        self.in_backward = False
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.grads_done: set[int] = set()

    def unshard(self) -> None:
        """Start gathering the full weights if they are not there yet (returns at once: prefetch)."""
        if not self.gathered:
            self.pending = [
                buf.start_gather(group) for buf, group in zip(self.buffers, self.buffer_groups, strict=True)
            ]
            self.gathered = True

    def wait(self) -> None:
        for work, _ in self.pending:
            timed_wait(work, "all_gather")
        self.pending = []

    def reshard(self) -> None:
        if self.gathered:
            self.wait()
            for buf in self.buffers:
                buf.free_params()
            self.gathered = False

    def buffer_grads_ready(self, buf: FlatBuffer) -> None:
        """Called when a buffer's gradients are complete; once all are, the unit's backward is over. A unit
        with frozen buffers may still need their weights then (input gradients through a frozen matrix come
        after its adapter's gradients): the next unit's pre-backward ends its backward (Zero3Hooks)."""
        self.grads_done.add(id(buf))
        if len(self.grads_done) == self.trainable == len(self.buffers):
            self.end_backward()

    def end_backward(self) -> None:
        self.grads_done.clear()
        self.in_backward = False
        self.reshard()


def _free_after_loss(units: list[Unit]) -> None:
    """HeadOutput.release: free the units a fused head's forward finished with once its loss has run (unless
    a backward has gathered them since)."""
    for unit in units:
        if not unit.in_backward:
            unit.reshard()


def output_tensors(output: object) -> Iterator[torch.Tensor]:
    """The tensors of a module's output, through any structure: tuples, lists, mappings (a Hugging Face
    ModelOutput is an OrderedDict) and dataclasses, nested. A fused head's HeadOutput counts by its input:
    the loss's gradient reaches the unit through it."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, HeadOutput):
        yield output.hidden
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from output_tensors(item)
    elif isinstance(output, Mapping):
        for item in output.values():
            yield from output_tensors(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from output_tensors(getattr(output, field.name))


class Zero3Hooks:
    """Gather a unit just before its forward and its backward, prefetch the next one, free it just after.

    The pre-backward trigger is a hook on the module's output tensor: it fires when the output's gradient
    is ready, i.e. right before the module's backward (and before an activation-checkpointed block recomputes
    its forward, which therefore finds the unit gathered and must not free it: `in_backward`).
    """

    def __init__(self, units: list[Unit], unit_of_param: dict[int, Unit]) -> None:
        self.units = units
        self.own: dict[nn.Module, Unit] = {m: u for u in units for m in u.modules}
        hooked = set(self.own)
        self.needed: dict[nn.Module, list[Unit]] = {}
        for module, own in self.own.items():
            needed = [own]
            for p in direct_params(module, hooked):
                unit = unit_of_param.get(id(p))
                if unit is not None and unit not in needed:
                    needed.append(unit)
            self.needed[module] = needed
        order = [m for u in units for m in u.modules]
        self.next_module = dict(zip(order, [*order[1:], None], strict=True))
        # The units an enclosing hooked module (the chunk, a whole-model unit) still needs once an inner one's
        # forward returns: a weight tied across them (a head tied to an embedding inside the inner module).
        self.enclosing: dict[nn.Module, set[Unit]] = {m: set() for m in order}
        for outer in order:
            for inner in outer.modules():
                if inner is not outer and inner in self.enclosing:
                    self.enclosing[inner].update(self.needed[outer])
        for module in order:
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self.units.index(unit) + step
        return self.units[i] if 0 <= i < len(self.units) else None

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        for unit in self.needed[module]:
            unit.unshard()
            unit.wait()
        own = self.own[module]
        following = self._neighbour(own, +1)
        if following is not None and not own.in_backward:
            following.unshard()

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        # A unit in backward stays gathered: an activation-checkpointed block recomputing its forward, or (zb1)
        # the next micro-batch's forward before this one's deferred weight gradients. Its outputs still get the
        # pre-backward hook: that micro-batch's backward must find the unit gathered again if it was freed.
        if not self.own[module].in_backward:
            next_module = self.next_module[module]
            keep = self.enclosing[module].union(self.needed[next_module] if next_module is not None else ())
            done = [u for u in self.needed[module] if u not in keep]
            if isinstance(output, HeadOutput):  # the fused loss computes with the weight after this forward
                output.release = functools.partial(_free_after_loss, done)
            else:
                for unit in done:
                    unit.reshard()
        if torch.is_grad_enabled():
            for t in output_tensors(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(lambda grad, m=module: self._pre_backward(m))

    def _pre_backward(self, module: nn.Module) -> None:
        for unit in self.needed[module]:
            unit.in_backward = True
            unit.unshard()
            unit.wait()
        previous = self._neighbour(self.own[module], -1)
        if previous is not None:
            previous.unshard()
        following = self._neighbour(self.own[module], +1)
        if following is not None and following.in_backward and following.trainable < len(following.buffers):
            following.end_backward()  # its backward fed this gradient: done, frozen weights included


def bucket_params(params: list[nn.Parameter], bucket_bytes: float, placements: Placements) -> list[list[nn.Parameter]]:
    """Buckets in reverse order of registration, which is roughly the order gradients become ready in backward,
    so the first buckets fill (and start reducing) early; one kind (decay or not) per bucket. A weight both
    ends of a pipeline hold (a tied embedding) is a bucket of its own, so both ends shard it alike."""
    buckets: list[list[nn.Parameter]] = []
    filling: dict[bool, list[nn.Parameter]] = {True: [], False: []}
    size = {True: 0, False: 0}
    for p in reversed(params):
        if placements[p].pp_tied:
            buckets.append([p])
            continue
        kind = decays(p)
        filling[kind].append(p)
        size[kind] += p.numel() * p.element_size()
        if size[kind] >= bucket_bytes:
            buckets.append(filling[kind])
            filling[kind], size[kind] = [], 0
    return buckets + [b for b in filling.values() if b]


def split_by_kind(params: list[nn.Parameter], placements: Placements) -> list[list[nn.Parameter]]:
    """Matrices, vectors, and each weight both ends of a pipeline hold alone (see bucket_params)."""
    alone = [[p] for p in params if placements[p].pp_tied]
    rest = [p for p in params if not placements[p].pp_tied]
    return alone + [group for group in ([p for p in rest if decays(p)], [p for p in rest if not decays(p)]) if group]


def by_grad_group(params: list[nn.Parameter], placements: Placements) -> dict[str, list[nn.Parameter]]:
    """`params` by the mesh group that reduces their gradients (Placement.grad_group): "replicas" first, then
    the others in order of appearance. Data parallel buckets each group apart, so no bucket mixes groups."""
    members: dict[str, list[nn.Parameter]] = {REPLICAS: []}
    for p in params:
        members.setdefault(placements[p].grad_group, []).append(p)
    return members
