"""The device mesh: named dimensions (pp outermost, dp, ep, cp, tp innermost) over all ranks.

tp is innermost so a tensor-parallel group stays inside a node (fast links), pp outermost so pipeline
neighbours may sit on different nodes (only point-to-point traffic), dp in between for scale. cp (context
parallel: each rank holds part of every sequence) sits next to tp: its ring traffic is per layer, like tp's.
ep (expert parallel: each rank holds a slice of every MoE layer's experts and gets rows of its own, like a
dp rank) sits between dp and cp: its all-to-all traffic is per MoE layer, heavier than dp's once per step.

Layouts and their checks need no torch (the planner and the config parser use them); `build_mesh` imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.errors import InputError
from meshlm.model.config import ModelConfig

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


def check_batch_split(layout: Layout, global_batch: int, micro_batch: int = 0) -> int:
    """The batch splits over the data replicas (dp × ep) and each replica's rows into micro-batches of
    `micro_batch` (0: one); return the micro-batches per replica."""
    dp = layout.data_parallel
    name = "dp×ep" if layout.ep > 1 else "dp"
    if global_batch % dp:
        raise LayoutError(f"train.global_batch ({global_batch}) is not divisible by {name}={dp}")
    local = global_batch // dp
    micro = micro_batch or local
    if local % micro:
        raise LayoutError(
            f"train.micro_batch ({micro}) must divide the per-replica batch global_batch/{name} = {local}"
        )
    return local // micro


def check_pipeline_chunks(layout: Layout, n_layers: int, virtual_stages: int = 1, schedule: str = "1f1b") -> None:
    """Each pipeline chunk gets a layer; virtual stages need the interleaved schedule."""
    chunks = layout.pp * virtual_stages
    if chunks > n_layers:
        raise LayoutError(f"pp×virtual_stages = {chunks} exceeds model.n_layers ({n_layers}); each chunk needs a layer")
    if virtual_stages > 1 and schedule != "interleaved":
        raise LayoutError(f"parallel.virtual_stages={virtual_stages} needs parallel.schedule = 'interleaved'")


def check_pipeline_schedule(layout: Layout, n_micro: int, schedule: str = "1f1b") -> None:
    """Enough micro-batches per replica for the schedule."""
    pp = layout.pp
    if pp > 1 and schedule in ("1f1b", "interleaved", "zb1") and n_micro < pp:
        raise LayoutError(
            f"schedule {schedule} needs at least pp={pp} micro-batches per replica, got {n_micro} "
            f"(set train.micro_batch so that the per-replica batch splits into at least {pp})"
        )
    if schedule == "interleaved" and pp > 1 and n_micro % pp:
        raise LayoutError(f"interleaved schedule needs micro-batches per replica ({n_micro}) divisible by pp={pp}")


def check_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Raise a one-line LayoutError if the model (or, under SP, the sequence) does not split over tp.
    Needs no process group: call it while validating the config."""
    if tp == 1:
        return
    moe = ("moe_intermediate_size", "shared_expert_intermediate_size") if cfg.n_experts else ()
    for field in ("n_heads", "intermediate_size", "vocab_size", *moe):
        if getattr(cfg, field) % tp:
            raise LayoutError(f"model.{field} ({getattr(cfg, field)}) is not divisible by tp={tp}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise LayoutError(
            f"model.n_kv_heads ({cfg.n_kv_heads}) must divide or be divisible by tp={tp} (KV heads split or replicated)"
        )
    if sequence_parallel and seq_len % tp:
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by tp={tp}, needed by parallel.sequence_parallel")


def check_expert_parallel(cfg: ModelConfig, layout: Layout) -> None:
    """Raise a one-line LayoutError if the model has no experts to split over ep or they do not split evenly
    (meshlm.parallel.expert_parallel; ep composes with dp, pp, cp and tp: check_tensor_parallel splits the
    experts' hidden units). Needs no process group."""
    ep = layout.ep
    if ep == 1:
        return
    if not cfg.n_experts:
        raise LayoutError(f"parallel.layout ep={ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if cfg.n_experts % ep:
        raise LayoutError(f"model.n_experts ({cfg.n_experts}) is not divisible by ep={ep}")


def check_context_parallel(
    cfg: ModelConfig, cp: int, tp: int, seq_len: int, attention: str, sequence_parallel: bool = False
) -> None:
    """Raise a one-line LayoutError if the sequence (ring) or the heads (Ulysses) do not split over cp.
    The ring's causal load balancing cuts each sequence into 2·cp chunks; Ulysses trades the sequence
    shard for cp-th of each rank's (tp-local) heads, query and key/value alike."""
    if cp == 1:
        return
    if attention not in ("ring", "ulysses"):
        raise LayoutError(f"parallel.cp_attention = {attention!r}; valid: 'ring', 'ulysses'")
    if cfg.sliding_window:
        raise LayoutError(f"context parallel (cp={cp}) needs full causal attention, not model.sliding_window")
    if seq_len and seq_len % (2 * cp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by 2·cp = {2 * cp} (load-balanced chunks)")
    if sequence_parallel and seq_len and seq_len % (cp * tp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by cp×tp = {cp * tp} under sequence_parallel")
    if attention == "ulysses":
        for field in ("n_heads", "n_kv_heads"):
            if getattr(cfg, field) % (cp * tp):
                raise LayoutError(
                    f"model.{field} ({getattr(cfg, field)}) is not divisible by cp×tp = {cp * tp}, "
                    f"needed by parallel.cp_attention = 'ulysses' (use 'ring')"
                )


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
