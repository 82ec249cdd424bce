"""ZeRO-1/2's weight all-gather after the optimizer step, overlapped with the next forward (Megatron's
overlap_param_gather).

After the step every rank holds new fp32 shards; the working weights (the flat buffers' `data`) must be
all-gathered from them before anything reads the weights. `ParamGathers.start` issues one asynchronous
all-gather per flat buffer, in forward order (the buffer whose parameters registered first goes first, so the
embedding's arrives first), and returns at once. Each buffer's gather is waited in the forward pre-hook of the
first module that uses its parameters (the ZeRO-3 units' modules of the plan: the chunk, its blocks, the
head...), so the next forward's early blocks compute while later buffers' gathers travel. The gathered bytes
are the same as a gather waited at once: only when the wait happens changes.

Whatever reads the weights elsewhere waits first:
  * a parameter whose buffer's gather is in flight is a PendingParameter: any torch operation that reads its
    values (state_dict, `.data`, a module reading a child's weight outside the child's forward, the replica
    desync check, generation) waits for the gathers of its owner first, then is a plain Parameter again;
  * DataParallel settles (waits for every gather) before it hands out or writes the fp32 shards the gathers
    read (checkpoint save and load, the guard's rollback, `named_steps`), before the optimizer steps
    (`finish_grad_sync`, once the backward is over) and before the next gather (`after_optimizer_step`).
A buffer no forward used (an unused layer) is therefore waited at the latest when the backward ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from meshlm.parallel.dp.zero import FlatBuffer, _describes, all_gather_flat, direct_params
from meshlm.parallel.parallel_plan import ParallelPlan, zero3_unit_groups
from meshlm.parallel.timers import timed_wait

# parameter -> the ParamGathers whose in-flight gather writes it (only while it is a PendingParameter)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class PendingParameter(nn.Parameter):
    """What a ZeRO-1/2 parameter is while the all-gather of its new weights is in flight: the same object,
    shape, dtype and hooks; an operation that reads its values waits for its owner's gathers first (and the
    parameter is then a plain Parameter again). What only describes it (shape, dtype, grad, data_ptr) does not
    wait."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        if not _describes(func):
            for leaf in tree_leaves((args, kwargs)):
                owner = _OWNERS.get(leaf) if isinstance(leaf, PendingParameter) else None
                if owner is not None:
                    owner.settle()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class ParamGathers:
    """The in-flight weight all-gathers of DataParallel's ZeRO-1/2 buffers, each waited where it is first
    needed (see the module docstring). `shard_group(buf)` is the group a buffer is sharded over."""

    def __init__(
        self,
        chunks: list[nn.Module],
        chunk_buffers: list[list[FlatBuffer]],
        shard_group: Callable[[FlatBuffer], dist.ProcessGroup | None],
        plan_of: Callable[[nn.Module], ParallelPlan],
    ) -> None:
        self.shard_group = shard_group
        self.order: list[FlatBuffer] = []  # forward order: by the first registered parameter of each buffer
        self.pending: dict[int, tuple[FlatBuffer, dist.Work]] = {}  # id(buffer) -> its gather in flight
        self.needed: dict[nn.Module, list[FlatBuffer]] = {}
        for chunk, buffers in zip(chunks, chunk_buffers, strict=True):
            position = {id(p): i for i, p in enumerate(chunk.parameters())}
            self.order += sorted(buffers, key=lambda buf: min(position[id(p)] for p in buf.params))
            buffer_of = {id(p): buf for buf in buffers for p in buf.params}
            modules = [m for group in zero3_unit_groups(chunk, plan_of(chunk)) for m in group]
            hooked = set(modules)
            for module in modules:
                needed = {id(b): b for p in direct_params(module, hooked) if (b := buffer_of.get(id(p))) is not None}
                if needed:
                    self.needed[module] = list(needed.values())
                    module.register_forward_pre_hook(self._pre_forward)

    @torch.no_grad()
    def start(self, overlap: bool) -> None:
        """All-gather every buffer's weights from its updated shard; with `overlap`, return while they travel
        (each waited where first needed), else wait for them all here."""
        self.settle()
        for buf in self.order:
            shard = buf.data[buf.shard]
            if shard.data_ptr() != buf.master.data_ptr():
                shard.copy_(buf.master)
            self.pending[id(buf)] = buf, all_gather_flat(buf.data, shard, group=self.shard_group(buf), async_op=True)
            for p in buf.params:
                p.__class__ = PendingParameter
                _OWNERS[p] = self
        if not overlap:
            self.settle()

    def wait(self, buf: FlatBuffer) -> None:
        """Wait for `buf`'s gather if it is in flight; its parameters are plain Parameters again."""
        entry = self.pending.pop(id(buf), None)
        if entry is not None:
            timed_wait(entry[1], "all_gather")
            for p, kind in zip(buf.params, buf.kinds, strict=True):
                p.__class__ = kind
                _OWNERS.pop(p, None)

    def settle(self) -> None:
        """Wait for every gather in flight, in the order they were issued."""
        for buf, _ in list(self.pending.values()):
            self.wait(buf)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if self.pending:
            for buf in self.needed[module]:
                self.wait(buf)
