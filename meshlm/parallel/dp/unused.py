"""Parameters no micro-batch of any rank touched in a step (an expert without tokens) are hidden from the
optimizer, which then skips them as one process's would: no momentum, no weight decay, no step count."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from meshlm.parallel.dp.replica_groups import Across
from meshlm.parallel.dp.zero import FlatBuffer
from meshlm.parallel.placement import Placements
from meshlm.parallel.timers import timed_wait


def hide_unused(
    buffers: list[FlatBuffer],
    group_of: Callable[[FlatBuffer], Hashable],
    placements: Placements,
    across: Across | None = None,
) -> None:
    """`.grad = None` on the optimizer tensors of every parameter of `buffers` that no rank reducing it used this
    step (FlatBuffer.used, reset here), until zero_grad. The step's flags are one tensor: each reduction group
    (`group_of(buf).group`) MAX-all-reduces its slice, all slices in flight at once, and a rank reads the result
    on the host once, and only when it has an unused parameter itself (a parameter that got a gradient here got
    one globally). A weight both pipeline ends hold counts as used (its embedding end always is). Under
    fault-tolerant replica groups `across` takes the MAX over the live groups too."""
    if not buffers:
        return
    by_group: dict[Hashable, list[FlatBuffer]] = {}
    for buf in buffers:
        by_group.setdefault(group_of(buf), []).append(buf)
    ordered = [buf for bufs in by_group.values() for buf in bufs]
    local = []
    for buf in ordered:
        if len(buf.params) == 1 and placements[buf.params[0]].pp_tied:
            buf.used[0] = True
        local += buf.used
        buf.used = [False] * len(buf.params)
    flags = torch.tensor(local, dtype=torch.uint8)
    device = buffers[0].data.device
    if device.type == "cuda":
        flags = flags.pin_memory().to(device, non_blocking=True)
    works, start = [], 0
    for groups, bufs in by_group.items():
        n = sum(len(buf.params) for buf in bufs)
        if dist.get_world_size(groups.group) > 1:
            works.append(
                dist.all_reduce(flags[start : start + n], op=dist.ReduceOp.MAX, group=groups.group, async_op=True)
            )
        start += n
    for work in works:
        timed_wait(work, "all_reduce")
    if across is not None:
        across.max_(flags)
    if all(local):
        return
    used, start = flags.tolist(), 0  # the step's one host read
    for buf in ordered:
        mine, start = used[start : start + len(buf.params)], start + len(buf.params)
        for step, owner in zip(buf.steps, buf.step_owner, strict=True):
            if not mine[owner]:
                step.grad = None
