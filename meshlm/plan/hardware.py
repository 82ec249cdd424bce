"""Device and link figures the planner prices work with, and the calibration JSON that replaces them.

Table figures are vendor datasheet numbers (dense bf16, no sparsity). Link bandwidths are stored as the
*bus bandwidth* an α–β model needs (the nccl-tests definition), taken as nominal per-direction link speed
times an achievable fraction. A calibration from `meshlm doctor` overrides any of them with measurements.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshlm.observe.peak import cpu_cores

GB = 2**30  # memory sizes are GiB, the unit the product names (A100-40GB, ...) and nvidia-smi use

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")

# Achievable fraction of nominal per-direction link speed for large messages (typical nccl-tests busbw).
NVLINK_EFFICIENCY = 0.8
NETWORK_EFFICIENCY = 0.9
# Size-independent host time per micro-batch of eager PyTorch until `meshlm doctor` measures it: one Llama
# layer's forward + backward is ~200 ops at a few µs of Python, dispatch and launch each; the rest of a
# micro-batch (embedding, head, loss, autograd set-up) about as much again.
LAYER_OVERHEAD_S = 0.5e-3
MICRO_BATCH_OVERHEAD_S = 0.3e-3


@dataclass(frozen=True)
class Link:
    """α–β cost of a link: alpha seconds per ring step, beta bus bandwidth in bytes/s."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Hardware:
    """One device type. Figures are per device; for `cpu` they describe the whole machine (`shared_node`)
    and `per_rank` splits them between the processes that share it."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (cpu: the measured fp32 matmul rate)
    memory_bytes: float
    memory_bw: float  # bytes/s, bounds the optimizer step
    intra: Link  # between devices of one node (NVLink)
    inter: Link  # between nodes, per device (one NIC per GPU, rail-optimised)
    gpus_per_node: int
    price_on_demand: float  # $ per device-hour, illustrative list prices
    price_spot: float
    framework_bytes: float = 2 * GB  # CUDA context, NCCL buffers, allocator reserve (cpu: python + torch)
    matmul_flops: float | None = None  # measured achievable matmul rate; None: use a fraction of peak
    shared_node: bool = False
    cores: float = 1.0  # shared_node: effective cores the ranks time-share (each rank runs one thread)
    layer_overhead_s: float = LAYER_OVERHEAD_S  # fixed host time of one layer's forward + backward
    micro_batch_overhead_s: float = MICRO_BATCH_OVERHEAD_S  # fixed host time per micro-batch besides layers
    gemm_efficiency: float = 0.5  # fraction of peak that a training step's GEMMs sustain (no calibration)
    attention_efficiency: float = 1.0  # flash-attention rate / GEMM rate where no kernel figures are published
    attention_chip: str | None = None  # whose published flash-attention figures price it (`meshlm.plan.attention`)
    matmul_max: float | None = None  # published maximum achievable bf16 matmul FLOP/s (`meshlm.plan.gemm`)
    nvls: bool = False  # NVLink SHARP: the NVSwitch reduces (H100/H200 DGX/HGX nodes); NCCL's NVLS algorithm
    # (dim|kind, op) -> Link; compared (two devices that differ only here price differently) but not hashed
    links: dict[tuple[str, str], Link] = field(default_factory=dict, hash=False)

    def link(self, dim: str, crosses_nodes: bool, op: str, rails: int = 1) -> Link:
        """The link a collective on mesh dim `dim` uses: measured per dim, else per link kind, else table.
        `rails`: the group's members in each node. A ring collective (all-reduce, all-gather, reduce-scatter)
        across nodes runs one ring per NIC (NCCL channels, rail-optimised), so a group with k members in each
        node drives k NICs per node: the table's per-GPU network figure times k, up to NVLink's."""
        kind = "inter" if crosses_nodes else "intra"
        measured = self.links.get((dim, op)) or self.links.get((kind, op))
        if measured:
            return measured
        if crosses_nodes and rails > 1 and op in RING_OPS:
            return Link(alpha=self.inter.alpha, beta=min(self.inter.beta * rails, self.intra.beta))
        return self.inter if crosses_nodes else self.intra

    def measured(self, dim: str, crosses_nodes: bool, op: str) -> bool:
        """Whether a calibration measured the link a collective on `dim` uses (then its α–β fit prices it)."""
        return (dim, op) in self.links or ("inter" if crosses_nodes else "intra", op) in self.links

    def per_rank(self, world: int, busy: float | None = None) -> Hardware:
        """Figures one rank gets: unchanged for GPUs. On a shared node memory is split between the `world`
        ranks, and the `busy` ranks (default: all) time-share the cores: a single-threaded rank runs at one
        core's rate, machine / cores, until there are more busy ranks than cores, then at machine / busy."""
        if not self.shared_node:
            return self
        share = max(busy if busy is not None else world, self.cores)
        return dataclasses.replace(
            self,
            peak_flops=self.peak_flops / share,
            matmul_flops=None if self.matmul_flops is None else self.matmul_flops / share,
            memory_bytes=self.memory_bytes / min(world, self.gpus_per_node),
            memory_bw=self.memory_bw / share,
        )


def _gpu(name, tflops, mamf, mem_gb, hbm_tbs, nvlink_gbs, net_gbs, on_demand, spot, gemm, chip, nvls) -> Hardware:
    return Hardware(
        name=name,
        peak_flops=tflops * 1e12,
        memory_bytes=mem_gb * GB,
        memory_bw=hbm_tbs * 1e12,
        intra=Link(alpha=3e-6, beta=nvlink_gbs * 1e9 * NVLINK_EFFICIENCY),
        inter=Link(alpha=8e-6, beta=net_gbs * 1e9 * NETWORK_EFFICIENCY),
        gpus_per_node=8,
        price_on_demand=on_demand,
        price_spot=spot,
        gemm_efficiency=gemm,
        attention_chip=chip,
        matmul_max=mamf * 1e12,
        nvls=nvls,
    )


# Sustained fraction of peak of a training step's large, well-shaped GEMMs (smaller ones run slower:
# `meshlm.plan.gemm`), one figure per chip generation, chosen against the published runs of docs/planner.md
# (A100: 14 Megatron-LM rows; H100: Llama 3 405B's two). Flash attention runs at its kernel's published rate
# for the step's sequence length and head dimension over the best GEMM kernel's (MAMF, below) times the same
# step efficiency (`meshlm.plan.attention`: the A100 and H100 figures; the H200 is the H100's chip).
A100_GEMM, H100_GEMM = 0.7, 0.6
# Maximum achievable bf16 matmul TFLOP/s (MAMF), the best over a brute-force search of shapes on one GPU
# (stas00/ml-engineering, compute/accelerator/README.md: A100 SXM 271.2, H100 SXM 794.5). No H200 row is
# published (GH200's 828.6 is the 900 W part); the H200 SXM is the same GH100 chip at the H100's 700 W.
A100_MAMF, H100_MAMF = 271.2, 794.5
# NVLink: A100 600 GB/s, H100/H200 900 GB/s bidirectional per GPU -> 300 / 450 per direction.
# Network: DGX A100 one 200 Gb/s HDR NIC per GPU (25 GB/s); DGX H100/H200 one 400 Gb/s NDR NIC (50 GB/s).
# Prices: illustrative cloud $/GPU-hour (on demand, spot); override them with --price-on-demand/--price-spot.
GPUS: dict[str, Hardware] = {
    g.name: g
    for g in (
        _gpu("A100-40GB", 312, A100_MAMF, 40, 1.555, 300, 25, 3.00, 1.20, A100_GEMM, "A100", False),
        _gpu("A100-80GB", 312, A100_MAMF, 80, 2.039, 300, 25, 3.50, 1.40, A100_GEMM, "A100", False),
        _gpu("H100-SXM", 989, H100_MAMF, 80, 3.35, 450, 50, 6.00, 2.50, H100_GEMM, "H100", True),
        _gpu("H200", 989, H100_MAMF, 141, 4.8, 450, 50, 7.00, 3.00, H100_GEMM, "H100", True),
    )
}
ALIASES = {"h100": "H100-SXM", "h100sxm": "H100-SXM", "h200sxm": "H200"}


def cpu_hardware() -> Hardware:
    """This machine, with placeholder speeds until `meshlm doctor` measures them: ~25 GFLOP/s fp32 matmul
    per core, 10 GB/s memory, gloo over loopback at 50 µs and 2 GB/s. All ranks live on one node."""
    cores = cpu_cores()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    loopback = Link(alpha=50e-6, beta=2e9)
    return Hardware(
        name="cpu",
        peak_flops=25e9 * cores,
        memory_bytes=ram,
        memory_bw=10e9,
        intra=loopback,
        inter=loopback,
        gpus_per_node=64,
        price_on_demand=0.0,
        price_spot=0.0,
        framework_bytes=0.5 * GB,
        matmul_flops=25e9 * cores,
        shared_node=True,
        cores=cores,
    )


class LinkFit(BaseModel):
    """A fitted collective cost t = steps·alpha_s + factor·bytes/beta_Bps (factor, steps: docs/planner.md)."""

    model_config = ConfigDict(extra="forbid")
    alpha_s: float = Field(ge=0)
    beta_Bps: float = Field(gt=0)


class Calibration(BaseModel):
    """What `meshlm doctor` writes (schema version 1, documented in docs/planner.md)."""

    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    device: str = "cpu"
    notes: dict = {}  # free-form provenance (host, versions, world size, date); not interpreted
    gpus_per_node: int | None = Field(None, gt=0)
    memory_bytes: float | None = Field(None, gt=0)
    memory_bw: float | None = Field(None, gt=0)
    matmul_flops: float | None = Field(None, gt=0)
    framework_bytes: float | None = Field(None, ge=0)
    cores: float | None = Field(None, ge=1)
    layer_overhead_s: float | None = Field(None, ge=0)
    micro_batch_overhead_s: float | None = Field(None, ge=0)
    links: dict[Literal["intra", "inter"], dict[Op, LinkFit]] = {}
    dims: dict[Literal["pp", "dp", "tp"], dict[Op, LinkFit]] = {}


def _device_key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def hardware(name: str | None = None, calibration: dict | None = None) -> Hardware:
    """Look up a device (case and punctuation ignored), then apply a calibration if given.

    Without a name the calibration's `device` is used. Raises ValueError with the valid names."""
    cal = None
    if calibration is not None:
        try:
            cal = Calibration.model_validate(calibration)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"calibration: {where}: {first['msg']}") from None
    name = name or (cal.device if cal else "cpu")
    table = {_device_key(k): v for k, v in GPUS.items()} | {k: GPUS[v] for k, v in ALIASES.items()}
    if _device_key(name) == "cpu":
        hw = cpu_hardware()
    elif _device_key(name) in table:
        hw = table[_device_key(name)]
    elif cal and cal.device == name and (measured := _measured(cal)):
        hw = measured
    else:
        raise ValueError(f"unknown gpu {name!r}; valid: {', '.join([*GPUS, 'cpu'])}, or a calibration measuring it")
    return apply_calibration(hw, cal) if cal else hw


def _measured(cal: Calibration) -> Hardware | None:
    """A GPU the table lacks, described wholly by its calibration (rate, memory, bandwidth and a link);
    its measured matmul rate stands in for the peak, and it has no price."""
    fits = [f for ops in (*cal.links.values(), *cal.dims.values()) for f in ops.values()]
    if cal.matmul_flops is None or cal.memory_bytes is None or cal.memory_bw is None or not fits:
        return None
    link = Link(fits[0].alpha_s, fits[0].beta_Bps)
    return Hardware(cal.device, cal.matmul_flops, cal.memory_bytes, cal.memory_bw, link, link, 8, 0.0, 0.0)


def apply_calibration(hw: Hardware, cal: Calibration) -> Hardware:
    """Replace table figures with measured ones; on cpu the measured matmul rate is also the peak."""
    links = {(kind, op): Link(f.alpha_s, f.beta_Bps) for kind, ops in cal.links.items() for op, f in ops.items()}
    links |= {(dim, op): Link(f.alpha_s, f.beta_Bps) for dim, ops in cal.dims.items() for op, f in ops.items()}
    changes: dict = {"links": links}
    names = ("gpus_per_node", "memory_bytes", "memory_bw", "matmul_flops", "framework_bytes", "cores")
    for name in (*names, "layer_overhead_s", "micro_batch_overhead_s"):
        if getattr(cal, name) is not None:
            changes[name] = getattr(cal, name)
    if hw.shared_node and cal.matmul_flops is not None:
        changes["peak_flops"] = cal.matmul_flops
    return dataclasses.replace(hw, **changes)
