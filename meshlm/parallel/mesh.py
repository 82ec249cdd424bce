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


@dataclass
class Mesh:
    """The layout plus this rank's process groups, one per named dimension, and flattened ones:
    "dp_cp"     the ranks that hold the same expert shard (the expert-data-parallel group): dp × cp;
    "replicas"  the ranks that hold the same dense weights and average their gradients: dp × ep × cp;
    "data"      the ranks that get rows of their own: dp × ep.
    Without ep the first two are the same ranks; without ep and cp all three are dp."""

    layout: Layout
    device_mesh: DeviceMesh
    flat: dict[str, DeviceMesh] = dataclasses.field(default_factory=dict)  # the flattened groups, where not dp

    def group(self, dim: str) -> dist.ProcessGroup:
        """A named dimension's group, or one of the flattened groups (see the class docstring)."""
        if dim in ("dp_cp", "replicas", "data"):
            return (self.flat.get(dim) or self.device_mesh["dp"]).get_group()
        return self.device_mesh[dim].get_group()

    def rank(self, dim: str) -> int:
        if dim == "data":  # dp-major: the rows of ep rank e of dp rank d follow those of (d, e - 1)
            return self.rank("dp") * self.layout.ep + self.rank("ep")
        return self.device_mesh[dim].get_local_rank()

    def size(self, dim: str) -> int:
        if dim == "data":
            return self.layout.data_parallel
        return getattr(self.layout, dim)


def build_mesh(layout: Layout, device_type: str) -> Mesh:
    """Create the (pp, dp, ep, cp, tp) DeviceMesh over the already-initialised default process group. Under
    cp the dp and cp dimensions are also flattened into "dp_cp": cp ranks hold the same weights and their
    gradients are partial sums over their tokens, so they reduce gradients (and shard ZeRO state) with dp.
    Under ep, "replicas" (dp × ep × cp) reduces the dense weights' gradients and "data" (dp × ep) splits the
    batch; the experts' gradients stay on "dp_cp"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world_size:
        raise LayoutError(f"layout {layout} needs {layout.world_size} ranks, the world has {dist.get_world_size()}")
    shape = tuple(getattr(layout, d) for d in DIMS)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    flat = {}
    if layout.cp > 1:
        flat["dp_cp"] = device_mesh["dp", "cp"]._flatten("dp_cp")
    if layout.ep > 1:
        flat["data"] = device_mesh["dp", "ep"]._flatten("data")
        flat["replicas"] = device_mesh["dp", "ep", "cp"]._flatten("replicas") if layout.cp > 1 else flat["data"]
    elif layout.cp > 1:
        flat["replicas"] = flat["dp_cp"]
    return Mesh(layout, device_mesh, flat)
