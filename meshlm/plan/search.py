"""Enumerate every valid layout for a workload on N devices, drop those that do not fit (saying why),
rank the rest by predicted throughput or cost, and pick one for the trainer (`parallel.layout auto`)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from meshlm.config import Config
from meshlm.model.flops import param_counts
from meshlm.plan.cost import DEFAULT_COSTS, CostModel, RunCost, run_cost
from meshlm.plan.hardware import GB, Hardware, hardware
from meshlm.plan.memory import (
    BYTES,
    DEFAULTS,
    Assumptions,
    Layout,
    Memory,
    Recompute,
    Schedule,
    Workload,
    memory,
)
from meshlm.plan.step_time import StepTime, bubble_fraction, step_time

Objective = Literal["throughput", "cost"]
MAX_GPUS = 2**17  # how far `does not fit` looks for a device count that would


class PlanError(ValueError):
    """A request the planner cannot satisfy, phrased as one line that says what would work."""


@dataclass(frozen=True)
class Constraints:
    """Choices fixed by the user; None leaves that dimension to the search."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    recompute: Recompute | None = None
    sequence_parallel: bool | None = None
    uneven_layers: bool = True  # allow n_layers not divisible by the pipeline split (docs/planner.md)
    max_micro_batch: int = 16
    recompute_options: tuple[Recompute, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class Rejection:
    layout: str
    reason: str  # a short category, counted in summaries
    detail: str
    memory: Memory | None = None


@dataclass(frozen=True)
class Plan:
    """One layout with its predicted memory, speed and cost."""

    layout: Layout
    micro_batches: int
    memory: Memory
    step: StepTime | None  # None only in memory-only searches
    cost: RunCost | None

    def to_dict(self) -> dict:
        """Plain JSON-ready values; infinities (a run that never finishes) become None."""
        lay = self.layout
        out = {
            "layout": lay.mesh,
            "gpus": lay.gpus,
            "pp": lay.pp,
            "dp": lay.dp,
            "tp": lay.tp,
            "zero": lay.zero,
            "micro_batch": lay.micro_batch,
            "micro_batches": self.micro_batches,
            "schedule": lay.schedule,
            "virtual_stages": lay.virtual_stages,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "memory_gb_per_gpu": self.memory.total / GB,
            "memory_parts_gb": self.memory.parts_gb(),
            "memory_stage": self.memory.stage,
            "step_time_s": self.step.total,
            "step_parts_s": self.step.parts(),
            "bubble_fraction": bubble_fraction(lay.schedule, lay.pp, self.micro_batches, lay.virtual_stages),
            "tokens_per_s": self.step.tokens_per_s,
            "tflops_per_gpu": self.step.tflops_per_gpu,
            "mfu": self.step.mfu,
            "train_days": self.step.train_days,
            "wall_days_on_demand": self.cost.wall_on_demand_s / 86400,
            "wall_days_spot": self.cost.wall_spot_s / 86400,
            "cost_usd_on_demand": self.cost.usd_on_demand,
            "cost_usd_spot": self.cost.usd_spot,
            "checkpoint_s": self.cost.checkpoint_s,
            "checkpoint_interval_s": self.cost.interval_on_demand_s,
            "checkpoint_interval_spot_s": self.cost.interval_spot_s,
        }
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in out.items()}


@dataclass
class SearchResult:
    plans: list[Plan] = field(default_factory=list)  # best first
    rejected: list[Rejection] = field(default_factory=list)

    def reasons(self) -> Counter:
        return Counter(r.reason for r in self.rejected)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_problem(w: Workload, gpus_per_node: int, pp: int, dp: int, tp: int, uneven: bool) -> tuple[str, str] | None:
    """Why a (pp, dp, tp) mesh cannot run this model, as (reason, detail), or None."""
    model = w.model
    checks = [
        (tp > gpus_per_node, "tp > GPUs per node", f"tp={tp} > {gpus_per_node} per node"),
        (model.n_heads % tp, "tp does not divide n_heads", f"n_heads={model.n_heads}, tp={tp}"),
        (
            model.n_kv_heads % tp and tp % model.n_kv_heads,
            "tp and n_kv_heads do not divide each other",
            f"n_kv_heads={model.n_kv_heads}, tp={tp}",
        ),
        (model.intermediate_size % tp, "tp does not divide intermediate_size", f"{model.intermediate_size} % {tp}"),
        (model.vocab_size % tp, "tp does not divide vocab_size", f"vocab_size={model.vocab_size}, tp={tp}"),
        (pp > model.n_layers, "pp > n_layers", f"pp={pp} > {model.n_layers} layers"),
        (not uneven and model.n_layers % pp, "pp does not divide n_layers", f"{model.n_layers} layers, pp={pp}"),
        (w.global_batch % dp, "dp does not divide global batch", f"global batch {w.global_batch}, dp={dp}"),
    ]
    return next(((reason, detail) for bad, reason, detail in checks if bad), None)


def _schedule_problem(w: Workload, lay: Layout, m: int, uneven: bool) -> tuple[str, str] | None:
    if lay.schedule == "1f1b" and lay.pp > 1 and m < lay.pp:
        return "1f1b needs micro-batches ≥ pp", f"m={m} < pp={lay.pp}"
    if lay.schedule != "interleaved":
        return None
    chunks, layers = lay.pp * lay.virtual_stages, w.model.n_layers
    checks = [
        (lay.pp == 1 or lay.virtual_stages < 2, "interleaved needs pp ≥ 2 and virtual stages ≥ 2", str(lay)),
        (m % lay.pp, "interleaved needs micro-batches divisible by pp", f"m={m}, pp={lay.pp}"),
        (uneven and chunks > layers + 2, "pp·v > n_layers + 2", f"pp·v={chunks}, {layers} layers"),
        (not uneven and layers % chunks, "pp·v does not divide n_layers", f"pp·v={chunks}, {layers} layers"),
    ]
    return next(((reason, detail) for bad, reason, detail in checks if bad), None)


def enumerate_layouts(
    w: Workload, gpus: int, gpus_per_node: int, c: Constraints, flash: bool = True
) -> Iterator[Layout | Rejection]:
    """Every combination the constraints allow, each either a structurally valid Layout or a Rejection.
    Selective recompute is skipped with flash attention, where it recomputes nothing."""
    meshes = [(pp, gpus // (tp * pp), tp) for tp in _divisors(gpus) for pp in _divisors(gpus // tp)]
    meshes = [(pp, dp, tp) for pp, dp, tp in meshes if (c.pp or pp, c.dp or dp, c.tp or tp) == (pp, dp, tp)]
    if not meshes:
        fixed = ",".join(f"{k}={v}" for k, v in (("pp", c.pp), ("dp", c.dp), ("tp", c.tp)) if v is not None)
        yield Rejection(fixed, "layout does not match the GPU count", f"{fixed} cannot make {gpus} GPUs")
        return
    recomputes = [c.recompute] if c.recompute else [r for r in c.recompute_options if not (flash and r == "selective")]
    for pp, dp, tp in meshes:
        mesh = f"pp={pp},dp={dp},tp={tp}"
        problem = _mesh_problem(w, gpus_per_node, pp, dp, tp, c.uneven_layers)
        per_replica = w.global_batch // dp
        if not problem and c.micro_batch and per_replica % c.micro_batch:
            problem = "micro-batch does not divide per-replica batch", f"{per_replica} % {c.micro_batch}"
        if problem:
            yield Rejection(mesh, *problem)
            continue
        choices = itertools.product(
            [c.micro_batch] if c.micro_batch else [b for b in _divisors(per_replica) if b <= c.max_micro_batch],
            _schedules(pp, c),
            [c.zero] if c.zero is not None else ([0] if dp == 1 else [0, 1, 2, 3]),
            recomputes,
            [c.sequence_parallel] if c.sequence_parallel is not None else ([False, True] if tp > 1 else [False]),
        )
        for b, (schedule, v), zero, recompute, sp in choices:
            lay = Layout(pp, dp, tp, zero, b, schedule, v, recompute, sp)
            problem = _schedule_problem(w, lay, per_replica // b, c.uneven_layers)
            yield Rejection(str(lay), *problem) if problem else lay


def _schedules(pp: int, c: Constraints) -> list[tuple[Schedule, int]]:
    """(schedule, virtual stages) pairs to try; without a pipeline the schedule is moot."""
    out: list[tuple[Schedule, int]] = []
    for name in [c.schedule] if c.schedule else (["1f1b"] if pp == 1 else ["gpipe", "1f1b", "interleaved"]):
        if name == "interleaved":
            out += [(name, v) for v in ([c.virtual_stages] if c.virtual_stages else range(2, 9))]
        else:
            out.append((name, 1))
    return out


def evaluate(
    w: Workload, layout: Layout, hw: Hardware, a: Assumptions = DEFAULTS, costs: CostModel = DEFAULT_COSTS
) -> Plan:
    """Memory, step time and run cost of one layout (whether or not it fits)."""
    step = step_time(w, layout, hw, a)
    w_bytes, _, o_bytes, _ = BYTES[w.precision]
    checkpoint = param_counts(w.model)["total"] * (w_bytes + o_bytes)  # weights + optimizer state
    cost = run_cost(step.train_days * 86400, layout.gpus, checkpoint, hw, costs)
    return Plan(layout, layout.micro_batches(w.global_batch), memory(w, layout, hw, a), step, cost)


def _rank_key(objective: Objective):
    if objective == "throughput":
        return lambda p: (-p.step.tokens_per_s, p.memory.total)
    return lambda p: (min(p.cost.usd_on_demand, p.cost.usd_spot), -p.step.tokens_per_s)


def search(
    w: Workload,
    gpus: int | list[int],
    hw: Hardware,
    objective: Objective = "throughput",
    constraints: Constraints = Constraints(),
    a: Assumptions = DEFAULTS,
    costs: CostModel = DEFAULT_COSTS,
    memory_only: bool = False,
) -> SearchResult:
    """Evaluate every valid layout on each device count in `gpus`; plans come back best first.
    With memory_only, plans carry no step time or cost (used to find what would fit)."""
    result = SearchResult()
    for n in [gpus] if isinstance(gpus, int) else gpus:
        capacity = hw.per_rank(n).memory_bytes
        for item in enumerate_layouts(w, n, hw.gpus_per_node, constraints, a.flash_attention):
            if isinstance(item, Rejection):
                result.rejected.append(item)
                continue
            mem = memory(w, item, hw, a)
            if mem.total > capacity:
                detail = f"needs {mem.total / GB:.1f} GB > {capacity / GB:.1f} GB"
                result.rejected.append(Rejection(str(item), "out of memory", detail, mem))
            elif memory_only:
                result.plans.append(Plan(item, item.micro_batches(w.global_batch), mem, None, None))
            else:
                result.plans.append(evaluate(w, item, hw, a, costs))
    key = (lambda p: p.memory.total) if memory_only else _rank_key(objective)
    result.plans.sort(key=key)
    return result


def best(
    w: Workload,
    gpus: int | list[int],
    hw: Hardware,
    objective: Objective = "throughput",
    constraints: Constraints = Constraints(),
    a: Assumptions = DEFAULTS,
    costs: CostModel = DEFAULT_COSTS,
) -> Plan:
    """The top-ranked plan, or PlanError saying why nothing works and what would."""
    result = search(w, gpus, hw, objective, constraints, a, costs)
    if not result.plans:
        raise PlanError(no_fit_message(w, gpus, hw, constraints, a, result))
    return result.plans[0]


def no_fit_message(
    w: Workload, gpus: int | list[int], hw: Hardware, c: Constraints, a: Assumptions, result: SearchResult
) -> str:
    """One line: why nothing works on these devices, and what would: the same device count with the fixed
    choices freed, else the smallest power-of-two multiple of it on which some layout fits (its fastest)."""
    n = gpus if isinstance(gpus, int) else max(gpus)
    oom = [r for r in result.rejected if r.memory is not None]
    if oom:
        smallest = min(oom, key=lambda r: r.memory.total)
        need, capacity = smallest.memory.total / GB, hw.per_rank(n).memory_bytes / GB
        msg = f"{w.name} does not fit on {n}× {hw.name}: smallest footprint {need:.1f} GB > {capacity:.1f} GB"
        msg += f" per GPU ({smallest.layout})"
    else:
        first = result.rejected[0]
        msg = f"no valid layout for {w.name} on {n}× {hw.name}: {first.layout}: {first.reason} ({first.detail})"
        if len(result.rejected) > 1:
            msg += "; rejected: " + ", ".join(f"{r} ×{k}" for r, k in result.reasons().most_common(3))
    free = Constraints(uneven_layers=c.uneven_layers, recompute_options=c.recompute_options)
    m = n if free != c else 2 * n
    while m <= (MAX_GPUS if oom else n):  # more devices only help when memory is the problem
        if search(w, m, hw, constraints=free, a=a, memory_only=True).plans:
            fastest = search(w, m, hw, constraints=free, a=a).plans[0]
            example = f"{fastest.layout} at {fastest.memory.total / GB:.1f} GB/GPU"
            return f"{msg}; {'fits as' if m == n else f'needs ≥ {m} GPUs, e.g.'} {example}"
        m *= 2
    return f"{msg}; nothing fits on up to {MAX_GPUS} GPUs" if oom else msg


def plan_for_config(cfg: Config, world_size: int, calibration: dict | None = None) -> Layout:
    """The fastest layout for a meshlm run config on `world_size` ranks, for `--parallel.layout auto`.

    The device comes from the calibration (its `device`), else cpu, or the local GPU's table entry.
    The pipeline split is kept even and recomputation limited to what the trainer has (none or full)."""
    model = cfg.model.build()
    hw = hardware(calibration.get("device") if calibration else _local_device(cfg), calibration)
    gpu = not hw.shared_node
    precision = {"fp32": "fp32", "bf16": "bf16", "auto": "bf16" if gpu else "fp32"}[cfg.train.dtype]
    w = Workload(
        model,
        cfg.data.seq_len,
        cfg.train.global_batch,
        cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len,
        precision,
        cfg.model.preset,
    )
    c = Constraints(
        micro_batch=cfg.train.micro_batch or None,
        uneven_layers=False,
        recompute_options=("none", "full"),
    )
    return best(w, world_size, hw, constraints=c).layout


def _local_device(cfg: Config) -> str:
    """The hardware-table entry for this machine's first GPU, or cpu."""
    import torch

    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    gib = torch.cuda.get_device_properties(0).total_memory / GB
    for key in ("H200", "H100"):
        if key in name:
            return key
    if "A100" in name:
        return "A100-80GB" if gib > 60 else "A100-40GB"
    raise PlanError(f"no planner figures for GPU {name!r}; pass a calibration from `meshlm doctor`")
