"""The network side of a step's time: α–β ring collectives over a link, and which links a mesh dimension's
groups cross (another node, how many NICs per node they drive). Formulas and sources: docs/planner.md."""

from __future__ import annotations

from functools import lru_cache

from meshlm.parallel.mesh import DIMS, Layout
from meshlm.plan.hardware import Link


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Ring collectives over n ranks in the α–β model; nbytes is the full buffer (nccl-tests convention)."""
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / link.beta + 2 * (n - 1) * link.alpha
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes / link.beta + (n - 1) * link.alpha
    if op == "send_recv":
        return nbytes / link.beta + link.alpha
    raise ValueError(f"unknown collective {op!r}")


# Flattened groups of several mesh dims (meshlm.parallel.mesh.Mesh): the expert-data-parallel group that
# reduces expert gradients, and the data replicas that reduce dense ones.
GROUPS = {"dp_cp": ("dp", "cp"), "replicas": ("dp", "ep", "cp")}


@lru_cache(maxsize=65536)
def crosses_nodes(mesh: Layout, dim: str, gpus_per_node: int) -> bool:
    """Whether some group of mesh dim `dim` (or flattened group, `GROUPS`) spans two nodes. Ranks are numbered
    pp outermost, then dp, ep, cp, tp innermost (rank = (((i_pp·dp + i_dp)·ep + i_ep)·cp + i_cp)·tp + i_tp)
    and fill nodes in order. A group's members are its first rank plus offsets up to `span`; it crosses when
    the first rank's offset within its node plus the span reaches the next node, which depends only on that
    offset. The first ranks are the sums of the other dims' coordinates times their strides; their offsets
    (mod the node size, at most that many) are built one dim at a time, and a dim's coordinates repeat their
    offsets after the node size, so each dim adds at most that many."""
    dims = GROUPS.get(dim, (dim,))
    strides, stride = {}, 1
    for d in reversed(DIMS):
        strides[d] = stride
        stride *= getattr(mesh, d)
    span = sum((getattr(mesh, d) - 1) * strides[d] for d in dims)
    offsets = {0}
    for d in DIMS:
        if d not in dims:
            steps = {c * strides[d] % gpus_per_node for c in range(min(getattr(mesh, d), gpus_per_node))}
            offsets = {(o + step) % gpus_per_node for o in offsets for step in steps}
    return max(offsets) + span >= gpus_per_node


@lru_cache(maxsize=4096)
def rails(mesh: Layout, dim: str, gpus_per_node: int) -> int:
    """The fewest members that a group of mesh dim `dim` (or flattened group, `GROUPS`) has in one of the
    nodes it spans, for the group of rank 0 (every group of a dim has the same stride pattern): how many
    NICs per node its ring collectives drive (`Hardware.link`)."""
    dims = GROUPS.get(dim, (dim,))
    strides, stride = {}, 1
    for d in reversed(DIMS):
        strides[d] = stride
        stride *= getattr(mesh, d)
    members = [0]
    for d in dims:
        members = [r + i * strides[d] for r in members for i in range(getattr(mesh, d))]
    per_node: dict[int, int] = {}
    for r in members:
        per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
    return min(per_node.values())
