"""The network side of a step's time: α–β ring collectives over a link, the algorithm NCCL would run a
collective with on a GPU (ring, tree, PAT, NVLS) and its time, and which links a mesh dimension's groups cross
(another node, how many NICs per node they drive). Formulas and sources: docs/planner.md."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from meshlm.parallel.mesh import DIMS, FLAT_GROUPS, Layout
from meshlm.plan.hardware import RING_OPS, Hardware, Link


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


# NCCL's cost model of a collective (src/graph/tuning.cc, its Simple protocol, the one of MB-sized training
# messages; NCCL 2.19 and later), read, not copied: a call costs a base latency per algorithm plus a latency
# per hop by the hop's link, and its bytes at the algorithm's bandwidth; NCCL runs the algorithm whose time
# is least. Seconds.
NCCL_BASE = {"ring": 8.4e-6, "tree": 8.4e-6, "pat": 8.4e-6, "nvls": 23e-6}
NCCL_HOP = {"nvlink": {"ring": 3.4e-6, "tree": 4.0e-6, "pat": 3.4e-6, "nvls": 25e-6}, "net": 14e-6}
# A tree moves each byte up and down the tree (algorithm bandwidth = half the bus bandwidth) at 0.9 of the
# ring's bus bandwidth (tuning.cc's tree refinement); a ring all-reduce moves 2(n − 1)/n of it.
TREE_BANDWIDTH = 0.9 * 0.5
# NVLink SHARP (NVSwitch 3, H100/H200): the switch reduces, so an all-reduce inside a node reaches a higher
# bus bandwidth than a ring. GB/s by group size, 8×H100 SXM, NCCL_ALGO=NVLS, 2–4 GB messages (NVIDIA/nccl#1455):
# the ring's ~370 up to 4 GPUs, then 420, 440, 460 and 480 at 5–8 GPUs; NCCL's maintainers give the same ~480
# against the ring's 370 for 8 GPUs, "a 30% improvement" (NVIDIA/nccl-tests#212, NVIDIA/nccl#1442).
NCCL_RING_BUSBW = 370
NVLS_BUSBW = {5: 420, 6: 440, 7: 460, 8: 480}


def nvls_speedup(n: int) -> float:
    """NVLS all-reduce bus bandwidth over the ring's for a group of n GPUs in one node."""
    return NVLS_BUSBW.get(min(n, 8), NCCL_RING_BUSBW) / NCCL_RING_BUSBW


class Algorithm(NamedTuple):
    """The algorithm NCCL would pick for a call and its predicted seconds."""

    name: str
    seconds: float


def nccl_algorithms(
    op: str, nbytes: float, n: int, per_node: int, intra: Link, inter: Link, nvls: bool = False
) -> dict[str, float]:
    """Seconds of one `op` call of `nbytes` (the full buffer, nccl-tests convention) over n ranks, `per_node`
    of them in each node they span, by every algorithm NCCL has for it: ring (every op; its n − 1 steps per
    pass, of which nodes − 1 cross the network), tree (all-reduce: up and down a tree, latency 2·((per node −
    1) NVLink hops + log2(nodes) network hops)), PAT (all-gather and reduce-scatter with one rank per node,
    NCCL 2.23: log2(n) network hops, ring bandwidth) and NVLS (all-reduce inside one node where the switch
    reduces). `intra` and `inter` are the NVLink and network links (their β the bus bandwidth the group's NICs
    give)."""
    if n == 1:
        return {"ring": 0.0}
    nodes = max(1, math.ceil(n / per_node))
    beta = inter.beta if nodes > 1 else intra.beta
    passes = 2 if op == "all_reduce" else 1
    hops = passes * (n - 1)
    net_hops = passes * (nodes - 1)
    nvlink = NCCL_HOP["nvlink"]
    out = {
        "ring": NCCL_BASE["ring"]
        + (hops - net_hops) * nvlink["ring"]
        + net_hops * NCCL_HOP["net"]
        + passes * (n - 1) / n * nbytes / beta
    }
    if op == "all_reduce":
        depth = (per_node - 1) * nvlink["tree"] + math.log2(nodes) * NCCL_HOP["net"]
        out["tree"] = NCCL_BASE["tree"] + 2 * depth + nbytes / (TREE_BANDWIDTH * beta)
        if nvls and nodes == 1:
            out["nvls"] = NCCL_BASE["nvls"] + nvlink["nvls"] + 2 * (n - 1) / n * nbytes / (nvls_speedup(n) * beta)
    elif per_node == 1 and nodes > 1:
        out["pat"] = NCCL_BASE["pat"] + math.log2(n) * NCCL_HOP["net"] + (n - 1) / n * nbytes / beta
    return out


def nccl_pick(op: str, nbytes: float, n: int, per_node: int, intra: Link, inter: Link, nvls: bool = False) -> Algorithm:
    """The algorithm NCCL's tuner would run the call with: the one of least predicted time."""
    times = nccl_algorithms(op, nbytes, n, per_node, intra, inter, nvls)
    name = min(times, key=times.__getitem__)
    return Algorithm(name, times[name])


def group_time(hw: Hardware, dim: str, crosses: bool, op: str, nbytes: float, n: int, per_node: int) -> float:
    """Seconds of one collective of mesh dim (or flattened group) `dim`: on a GPU of the table, as NCCL would
    run it (`nccl_pick`; a group crossing nodes with `per_node` members in each drives that many NICs); where
    a calibration measured the link, or on cpu (gloo), the α–β ring over that link."""
    link = hw.link(dim, crosses, op, per_node if crosses else 1)
    if op not in RING_OPS or hw.shared_node or hw.measured(dim, crosses, op):
        return collective_time(op, nbytes, n, link)
    inter = link if crosses else hw.inter
    return nccl_pick(op, nbytes, n, per_node if crosses else n, hw.intra, inter, hw.nvls).seconds


@lru_cache(maxsize=65536)
def crosses_nodes(mesh: Layout, dim: str, gpus_per_node: int) -> bool:
    """Whether some group of mesh dim `dim` (or flattened group, `FLAT_GROUPS`) spans two nodes. Ranks are numbered
    pp outermost, then dp, ep, cp, tp innermost (rank = (((i_pp·dp + i_dp)·ep + i_ep)·cp + i_cp)·tp + i_tp)
    and fill nodes in order. A group's members are its first rank plus offsets up to `span`; it crosses when
    the first rank's offset within its node plus the span reaches the next node, which depends only on that
    offset. The first ranks are the sums of the other dims' coordinates times their strides; their offsets
    (mod the node size, at most that many) are built one dim at a time, and a dim's coordinates repeat their
    offsets after the node size, so each dim adds at most that many."""
    dims = FLAT_GROUPS.get(dim, (dim,))
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
    """The fewest members that a group of mesh dim `dim` (or flattened group, `FLAT_GROUPS`) has in one of the
    nodes it spans, for the group of rank 0 (every group of a dim has the same stride pattern): how many
    NICs per node its ring collectives drive (`Hardware.link`)."""
    dims = FLAT_GROUPS.get(dim, (dim,))
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
