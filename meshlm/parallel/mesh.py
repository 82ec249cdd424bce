"""The device mesh: named dimensions (pp outermost, dp, ep, cp, tp innermost) over all ranks.

tp is innermost so a tensor-parallel group stays inside a node (fast links), pp outermost so pipeline
neighbours may sit on different nodes (only point-to-point traffic), dp in between for scale. cp (context
parallel: each rank holds part of every sequence) sits next to tp: its ring traffic is per layer, like tp's.
ep (expert parallel: each rank holds a slice of every MoE layer's experts and gets rows of its own, like a
dp rank) sits between dp and cp: its all-to-all traffic is per MoE layer, heavier than dp's once per step.

Layouts need no torch (the planner and the config parser use them; each strategy's size rules sit with its class in
meshlm.parallel.strategies); `build_mesh` imports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.errors import InputError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "ep", "cp", "tp")


class LayoutError(InputError):
    """An impossible parallel layout, phrased as one line naming what would be valid."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that get rows of their own: dp × ep (an ep rank is a data replica for the dense layers)."""
        return self.dp * self.ep

    def __str__(self) -> str:
        """ep and cp are named only when used, so layouts without them read as before."""
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS if d not in ("ep", "cp") or getattr(self, d) > 1)


def parse_layout(text: str, world_size: int) -> Layout:
    """Parse 'pp=2,dp=2,tp=2'. Omitted dims are 1, except dp, which takes whatever the world leaves."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in DIMS:
            raise LayoutError(f"parallel.layout: unknown dimension {name!r} in {text!r}; valid: {', '.join(DIMS)}")
        if name in sizes:
            raise LayoutError(f"parallel.layout: dimension {name!r} given twice in {text!r}")
        if not value.strip().isdigit() or int(value) < 1:
            raise LayoutError(f"parallel.layout: {name}={value!r} must be a positive integer")
        sizes[name] = int(value)
    if "dp" not in sizes:
        rest = sizes.get("pp", 1) * sizes.get("ep", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
        if world_size % rest:
            raise LayoutError(
                f"parallel.layout {text!r}: {product(sizes, 'pp', 'ep', 'cp', 'tp')} = {rest} does not divide "
                f"the world size {world_size}"
            )
        sizes["dp"] = world_size // rest
    layout = Layout(**sizes)
    if layout.world_size != world_size:
        raise LayoutError(
            f"parallel.layout {text!r}: {product(sizes, *DIMS)} = {layout.world_size} but the world size is "
            f"{world_size}"
        )
    return layout


def product(sizes: dict[str, int], *dims: str) -> str:
    """'pp×cp×tp' for the dims of a layout's product; ep is named only when the layout gives it."""
    return "×".join(d for d in dims if d != "ep" or d in sizes)


# The flattened mesh groups, each one meaning, named by what its ranks share (dp-major, in mesh order):
FLAT_GROUPS = {
    "batch": ("dp", "ep"),  # the ranks the global batch is split over: each gets rows of its own
    "replicas": ("dp", "ep", "cp"),  # the ranks holding the same whole weights: they average those gradients
    "expert_replicas": ("dp", "cp"),  # the ranks holding the same expert shard: they average its gradients
}


@dataclass
class Mesh:
    """The layout plus this rank's process groups, one per named dimension, and the flattened ones (FLAT_GROUPS):
    "batch"            dp × ep: the ranks that get rows of their own (an ep rank is a data replica for the
                       dense layers), over which the global batch is split;
    "replicas"         dp × ep × cp: the ranks that hold the same whole (dense) weights and average their
                       gradients, and whose per-token loss terms make the global mean;
    "expert_replicas"  dp × cp: the ranks that hold the same expert shard and average its gradients.
    Without ep, "replicas" and "expert_replicas" are the same ranks; without ep and cp all three are dp."""

    layout: Layout
    device_mesh: DeviceMesh
    flat: dict[str, DeviceMesh] = dataclasses.field(default_factory=dict)  # the flattened groups, where not dp

    def group(self, dim: str) -> dist.ProcessGroup:
        """A named dimension's group, or one of the flattened groups (see the class docstring)."""
        if dim in FLAT_GROUPS:
            return (self.flat.get(dim) or self.device_mesh["dp"]).get_group()
        return self.device_mesh[dim].get_group()

    def rank(self, dim: str) -> int:
        """This rank's index in a dimension's group; in a flattened group dp-major (the rows of ep rank e of dp
        rank d follow those of (d, e - 1))."""
        if dim in FLAT_GROUPS:
            rank = 0
            for d in FLAT_GROUPS[dim]:
                rank = rank * self.size(d) + self.rank(d)
            return rank
        return self.device_mesh[dim].get_local_rank()

    def size(self, dim: str) -> int:
        if dim in FLAT_GROUPS:
            return math.prod(getattr(self.layout, d) for d in FLAT_GROUPS[dim])
        return getattr(self.layout, dim)


def build_mesh(layout: Layout, device_type: str) -> Mesh:
    """Create the (pp, dp, ep, cp, tp) DeviceMesh over the already-initialised default process group, and the
    flattened groups (FLAT_GROUPS) where they are more than dp. Under cp, "expert_replicas" flattens dp and cp:
    cp ranks hold the same weights and their gradients are partial sums over their tokens, so they reduce
    gradients (and shard ZeRO state) with dp; without ep it is also "replicas". Under ep, "replicas" (dp × ep ×
    cp) reduces the whole weights' gradients and "batch" (dp × ep) splits the batch; the experts' gradients
    stay on "expert_replicas"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world_size:
        raise LayoutError(f"layout {layout} needs {layout.world_size} ranks, the world has {dist.get_world_size()}")
    shape = tuple(getattr(layout, d) for d in DIMS)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    flat = {}
    if layout.cp > 1:
        flat["expert_replicas"] = device_mesh["dp", "cp"]._flatten("expert_replicas")
    if layout.ep > 1:
        flat["batch"] = device_mesh["dp", "ep"]._flatten("batch")
        flat["replicas"] = device_mesh["dp", "ep", "cp"]._flatten("replicas") if layout.cp > 1 else flat["batch"]
    elif layout.cp > 1:
        flat["replicas"] = flat["expert_replicas"]
    return Mesh(layout, device_mesh, flat)
