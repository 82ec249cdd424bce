"""Enumerate every valid layout for a workload on N devices, drop those that do not fit (saying why),
rank the rest by predicted throughput or cost, and pick one for the trainer (`parallel.layout auto`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

from meshlm.config import Config
from meshlm.errors import InputError
from meshlm.model.flops import param_counts
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.ep.strategy import check_expert_parallel
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.strategies import check_layout
from meshlm.plan.cost import DEFAULT_COSTS, CostModel, nodes_of, rates, run_cost
from meshlm.plan.hardware import GB, Hardware, hardware
from meshlm.plan.memory import (
    BYTES,
    DEFAULTS,
    Assumptions,
    Candidate,
    Memory,
    Recompute,
    Workload,
    memory,
    memory_floor,
    memory_key,
)
from meshlm.plan.pipeline_split import Runtime, ScheduleName, chunk_layers, max_chunks
from meshlm.plan.spot import Estimate, Offerings, Pool, estimate
from meshlm.plan.step_time import StepTime, bubble_fraction, step_time

Objective = Literal["throughput", "cost"]
MAX_GPUS = 2**17  # how far `does not fit` looks for a device count that would
CP_MIN_SEQ_LEN = 8192  # shorter sequences: no context parallelism unless asked for or nothing fits without it


class PlannerError(InputError):
    """A request the planner cannot satisfy, phrased as one line that says what would work."""


@dataclass(frozen=True)
class Constraints:
    """Choices fixed by the user; None leaves that dimension to the search."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: ScheduleName | None = None
    virtual_stages: int | None = None
    recompute: Recompute | None = None
    recompute_layers: int | None = None  # None: 0, or the fewest that make a layout fit (`fill_memory`)
    sequence_parallel: bool | None = None
    cp_attention: Literal["ring", "ulysses"] | None = None
    uneven_layers: bool = True  # allow n_layers not divisible by the pipeline split (docs/planner.md)
    max_micro_batch: int = 16
    memory_gb: float | None = None  # usable memory per device; None: the device's
    recompute_options: tuple[Recompute, ...] = ("none", "selective", "mlp", "full")


@dataclass(frozen=True)
class Rejection:
    layout: str
    reason: str  # a short category, counted in summaries
    detail: str
    memory: Memory | None = None


@dataclass(frozen=True)
class Plan:
    """One strategy with its predicted memory, speed and cost. `on_demand` prices every evaluated plan;
    `offerings` (spot, mixed, spares, elastic shrink) only those a search returns first (`price`)."""

    strategy: Candidate
    micro_batches: int
    memory: Memory
    step: StepTime | None  # None only in memory-only searches
    on_demand: Estimate | None
    offerings: Offerings | None = None
    checkpoint_bytes: float = 0.0

    @property
    def cost(self) -> Estimate | None:
        """The recommended pool's estimate once priced, else on demand's."""
        return self.offerings.recommended if self.offerings else self.on_demand

    def to_dict(self) -> dict:
        """Plain JSON-ready values; infinities (a run that never finishes) become None."""
        s, cost = self.strategy, self.cost
        out = {
            "layout": s.layout,
            "gpus": s.gpus,
            "pp": s.pp,
            "dp": s.dp,
            "tp": s.tp,
            "cp": s.cp,
            "ep": s.ep,
            "cp_attention": s.cp_attention if s.cp > 1 else None,
            "zero": s.zero,
            "micro_batch": s.micro_batch,
            "micro_batches": self.micro_batches,
            "schedule": s.schedule,
            "virtual_stages": s.virtual_stages,
            "recompute": s.recompute,
            "recompute_layers": s.recompute_layers,
            "sequence_parallel": s.sequence_parallel,
            "memory_gb_per_gpu": self.memory.total / GB,
            "memory_parts_gb": self.memory.parts_gb(),
            "memory_stage": self.memory.stage,
            "step_time_s": self.step.total,
            "step_parts_s": self.step.parts(),
            "bubble_fraction": bubble_fraction(s.schedule, s.pp, self.micro_batches, s.virtual_stages),
            "tokens_per_s": self.step.tokens_per_s,
            "tflops_per_gpu": self.step.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.step.hardware_tflops_per_gpu,
            "mfu": self.step.mfu,
            "train_days": self.step.train_days,
            "checkpoint_gb": self.checkpoint_bytes / 1e9,
            "wall_days_on_demand": self.on_demand.wall_s / 86400,
            "cost_usd_on_demand": self.on_demand.usd,
            "wall_days": cost.wall_s / 86400,
            "cost_usd": cost.usd,
            "restarts": cost.restarts,
            "checkpoint_interval_s": cost.interval_s,
            "pool": cost.pool.describe(),
        }
        out = {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in out.items()}
        if self.offerings:
            out["offerings"] = self.offerings.to_dict()
        return out


@dataclass
class SearchResult:
    plans: list[Plan] = field(default_factory=list)  # best first
    rejected: list[Rejection] = field(default_factory=list)

    def reasons(self) -> Counter:
        return Counter(r.reason for r in self.rejected)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def _options(zero: int, schedule: ScheduleName, virtual_stages: int, sp: bool, attention: str) -> ParallelOptions:
    """The options a candidate sets, built (validated) once per combination: the search meets each many times."""
    return ParallelOptions(
        zero=zero, schedule=schedule, virtual_stages=virtual_stages, sequence_parallel=sp, cp_attention=attention
    )


def _loosest(mesh: Layout, micro_batch: int | None) -> Candidate:
    """`mesh` with the choices that pass the most runtime checks: no sequence parallelism, ring attention,
    gpipe without virtual stages, the fixed micro-batch or else the whole replica batch as one (0). A mesh
    this fails fails with every choice, so it is rejected once."""
    return Candidate(mesh, ParallelOptions(schedule="gpipe"), micro_batch=micro_batch or 0)


def layout_problem(
    w: Workload, s: Candidate, chunks: int, uneven: bool = True, runtime: Runtime = "meshlm"
) -> tuple[str, str] | None:
    """Why the runtime would refuse strategy `s` for this workload, as (reason, detail), or None. These are
    the trainer's own checks (every strategy's check_layout, meshlm.parallel.strategies; `chunks`, the most
    pipeline chunks the modelled runtime cuts the model into, is n_layers for meshlm's), so the planner never
    proposes a layout the trainer refuses nor leaves out one it runs (for meshlm's model, the strategies' checks
    of the model against its plan refuse nothing the size checks accept: tests/unit/test_layout_agreement.py runs
    both on the runtime side). The Megatron-style runtime composes ep with tp,
    pp and cp: its layout is checked with the ep ranks counted as data replicas, plus the experts' split over
    ep. `uneven=False` adds the planner-only preference for n_layers divisible by the pipeline split. A
    micro_batch of 0 is the whole replica batch."""
    mesh = s.mesh if runtime == "meshlm" else dataclasses.replace(s.mesh, dp=s.dp * s.ep, ep=1)
    spec = LayoutSpec(w.model, mesh, w.global_batch, s.micro_batch, w.seq_len, s.options, n_layers=chunks)
    try:
        check_layout(spec)
        if runtime != "meshlm":
            check_expert_parallel(w.model, Layout(ep=s.ep))
    except LayoutError as e:
        return re.sub(r"(?<![A-Za-z])\d+(?![A-Za-z])", "N", str(e)), str(e)  # reason: the message, numbers as N
    split = s.pp * s.virtual_stages
    if not uneven and w.model.n_layers % split:
        return "pipeline split does not divide n_layers", f"{w.model.n_layers} layers, pp·v={split}"
    return None


def enumerate_strategies(
    w: Workload, gpus: int, gpus_per_node: int, c: Constraints, a: Assumptions = DEFAULTS
) -> Iterator[Candidate | Rejection]:
    """Every combination the constraints allow, each either a Candidate the runtime accepts or a Rejection
    saying why it would not (`layout_problem`). tp stays within a node. Selective recompute is skipped with
    flash attention, where it recomputes nothing; a fixed `recompute_layers` > 0 skips full recompute. ep is
    searched for MoE models only (every divisor of the device count; the checks keep those that divide
    n_experts), or where the constraints fix it."""
    flash, chunks = a.flash_attention, max_chunks(w.model, a.runtime)
    eps = _divisors(gpus) if w.model.n_experts or c.ep else [1]
    meshes = [
        Layout(pp, gpus // (tp * cp * pp * ep), tp, cp, ep)
        for ep in eps
        for tp in _divisors(gpus // ep)
        for cp in _divisors(gpus // (ep * tp))
        for pp in _divisors(gpus // (ep * tp * cp))
    ]
    fixed = {d: v for d in ("pp", "dp", "cp", "tp", "ep") if (v := getattr(c, d)) is not None}
    meshes = [m for m in meshes if all(getattr(m, d) == v for d, v in fixed.items())]
    if not meshes:
        named = ",".join(f"{d}={v}" for d, v in fixed.items())
        yield Rejection(named, "layout does not match the GPU count", f"{named} cannot make {gpus} GPUs")
        return
    recomputes = [c.recompute] if c.recompute else [r for r in c.recompute_options if not (flash and r == "selective")]
    if c.recompute_layers:
        recomputes = [r for r in recomputes if r != "full"]
    for mesh in meshes:
        if mesh.tp > gpus_per_node:
            yield Rejection(str(mesh), "tp > GPUs per node", f"tp={mesh.tp} > {gpus_per_node} per node")
            continue
        problem = layout_problem(w, _loosest(mesh, c.micro_batch), chunks, runtime=a.runtime)
        if problem:
            yield Rejection(str(mesh), *problem)
            continue
        per_replica = w.global_batch // mesh.data_parallel
        choices = itertools.product(
            [c.micro_batch] if c.micro_batch else [b for b in _divisors(per_replica) if b <= c.max_micro_batch],
            _schedules(mesh.pp, c, max_chunks(w.model, a.runtime)),
            [c.zero] if c.zero is not None else ([0] if mesh.dp * mesh.ep * mesh.cp == 1 else [0, 1, 2, 3]),
            recomputes,
            [c.sequence_parallel] if c.sequence_parallel is not None else ([False, True] if mesh.tp > 1 else [False]),
            [c.cp_attention] if c.cp_attention else (["ring", "ulysses"] if mesh.cp > 1 else ["ring"]),
        )
        checked: dict[tuple, tuple[str, str] | None] = {}  # the runtime's checks do not read the recompute policy
        for b, (schedule, v), zero, recompute, sp, attention in choices:
            chosen = _options(zero, schedule, v, sp, attention)
            lay = Candidate(mesh, chosen, b, recompute, c.recompute_layers or 0)
            if (b, chosen) not in checked:
                checked[b, chosen] = layout_problem(w, lay, chunks, c.uneven_layers, a.runtime)
            problem = checked[b, chosen]
            yield Rejection(str(lay), *problem) if problem else lay


def fill_memory(
    w: Workload, s: Candidate, hw: Hardware, a: Assumptions, limit: float
) -> tuple[Candidate, Memory] | None:
    """`s` with the fewest fully recomputed layers per pipeline chunk (`train.recompute_layers`, Megatron's
    `--recompute-num-layers`) that bring it within `limit` bytes, and its memory; None if even all but one
    layer of each chunk do not (all of them is `recompute = full`, searched on its own). Memory falls and
    step time rises with each recomputed layer, so the fewest that fit is the fastest of them."""
    most = max(chunk_layers(w.model, s.pp * s.virtual_stages, a.runtime)) - 1  # the largest chunk's, less one
    if s.recompute == "full" or most < 1 or memory_floor(w, s, hw, a) > limit:
        return None
    top = dataclasses.replace(s, recompute_layers=most)
    mem = memory(w, top, hw, a)
    if mem.total > limit:
        return None
    found, low, high = (top, mem), 1, most - 1
    while low <= high:  # binary search over the monotone memory(k)
        k = (low + high) // 2
        candidate = dataclasses.replace(s, recompute_layers=k)
        mem = memory(w, candidate, hw, a)
        if mem.total <= limit:
            found, high = (candidate, mem), k - 1
        else:
            low = k + 1
    return found


def _sized(
    w: Workload, s: Candidate, hw: Hardware, a: Assumptions, limit: float, c: Constraints
) -> tuple[Memory, Memory, int]:
    """(memory of `s`, memory of what the search keeps, its recompute_layers): `s` itself, or where it does not
    fit and the constraints leave recompute_layers free, `s` with the fewest that fit (`fill_memory`)."""
    mem = memory(w, s, hw, a)
    if mem.total > limit and c.recompute_layers is None:
        filled = fill_memory(w, s, hw, a, limit)
        if filled is not None:
            return mem, filled[1], filled[0].recompute_layers
    return mem, mem, s.recompute_layers


def _schedules(pp: int, c: Constraints, chunks: int = 8) -> list[tuple[ScheduleName, int]]:
    """(schedule, virtual stages) pairs to try: interleaved with v from 2 to 8 (past the layers, the runtime's
    check rejects them with its reason) and, as far as `chunks` (the most the runtime splits the layers into)
    allows, every larger v that splits a stage's layers evenly (Nemotron-4 340B's 96 layers run as pp 8 × v
    12); without a pipeline the schedule is moot. zb1 only when asked
    for: meshlm's executor has no split-backward kernels (its W pass re-walks the graph, `ZB1_REWALK`, which
    is measured on CPU only), and the Megatron-style runtime of the published runs has no such schedule."""
    out: list[tuple[ScheduleName, int]] = []
    names = [c.schedule] if c.schedule else (["1f1b"] if pp == 1 else ["gpipe", "1f1b", "interleaved"])
    for name in names:
        if name == "interleaved":
            out += [(name, v) for v in ([c.virtual_stages] if c.virtual_stages else _virtual_stages(chunks // pp))]
        else:
            out.append((name, c.virtual_stages or 1))
    return out


def _virtual_stages(per_stage: int) -> list[int]:
    """2…8, then the divisors of the chunks a stage can hold above 8."""
    return [*range(2, 9), *(v for v in range(9, per_stage + 1) if per_stage % v == 0)]


@cache
def predicted_checkpoint_bytes(w: Workload) -> float:
    """Bytes of one checkpoint: every parameter's weight and optimizer state."""
    w_bytes, _, o_bytes, _ = BYTES[w.precision]
    return param_counts(w.model)["total"] * (w_bytes + o_bytes)


def plan_strategy(
    w: Workload,
    strategy: Candidate,
    hw: Hardware,
    a: Assumptions = DEFAULTS,
    costs: CostModel = DEFAULT_COSTS,
    mem: Memory | None = None,
) -> Plan:
    """Memory (`mem` when the caller has it), step time and on-demand cost of one strategy (whether or not
    it fits)."""
    step = step_time(w, strategy, hw, a)
    ckpt = predicted_checkpoint_bytes(w)
    nodes = nodes_of(strategy.gpus, hw.gpus_per_node)
    pool = Pool(nodes, strategy.gpus / nodes)
    cost = estimate(step.train_days * 86400, pool, rates(strategy.gpus, ckpt, hw, costs))
    mem = mem or memory(w, strategy, hw, a)
    return Plan(strategy, strategy.micro_batches(w.global_batch), mem, step, cost, checkpoint_bytes=ckpt)


# Kept free on a GPU beyond the predicted peak: the CUDA context's and NCCL's buffers grow with the job, and
# the caching allocator needs slack to place a large block (a plan at 79.9 of 80 GiB dies on the first
# unlucky fragmentation). A fraction, so it scales with the device.
ALLOCATOR_RESERVE = 0.04


def capacity(hw: Hardware, gpus: int, c: Constraints) -> float:
    """Usable bytes per device: the constraint's, else the device's share less ALLOCATOR_RESERVE (GPUs)."""
    if c.memory_gb is not None:
        return c.memory_gb * GB
    share = hw.per_rank(gpus).memory_bytes
    return share if hw.shared_node else share * (1 - ALLOCATOR_RESERVE)


def elastic_shrink(
    w: Workload, strategy: Candidate, hw: Hardware, a: Assumptions = DEFAULTS, c: Constraints = Constraints()
) -> tuple[Callable[[int], float], int | None]:
    """What an elastic job keeps after losing nodes: (throughput on n nodes relative to the full strategy, the
    fewest nodes of the range it can run on). On n nodes torchrun starts n × gpus_per_node ranks and
    `--parallel.layout pp=P,tp=T` makes dp = ranks / (P·T): n is a valid count only when that dp is whole,
    divides the global batch and the schedule, and fits in memory (speed 0 otherwise, as the restart would
    fail). The range is [fewest, nodes] with every count in it valid, since `--nnodes MIN:MAX` lets torchrun
    start at any of them: the priced states are exactly the ones the emitted launch can run in."""
    s, g = strategy, hw.gpus_per_node
    unit = s.pp * s.ep * s.cp * s.tp
    full = step_time(w, s, hw, a).tokens_per_s
    chunks = max_chunks(w.model, a.runtime)

    @cache
    def at(dp: int) -> float:
        shrunk = dataclasses.replace(s, mesh=dataclasses.replace(s.mesh, dp=dp))
        if layout_problem(w, shrunk, chunks, c.uneven_layers, a.runtime):
            return 0.0
        if memory(w, shrunk, hw, a).total > capacity(hw, shrunk.gpus, c):
            return 0.0
        return step_time(w, shrunk, hw, a).tokens_per_s / full

    full_nodes = nodes_of(s.gpus, g)
    per_node = s.gpus / full_nodes  # the launch's --nproc-per-node

    @cache
    def speed(nodes: int) -> float:
        ranks = round(nodes * per_node)
        if nodes > full_nodes or nodes < 1 or ranks != nodes * per_node or ranks % unit:
            return 0.0
        return at(ranks // unit) if ranks // unit <= s.dp else 0.0

    fewest = full_nodes
    while fewest > 1 and speed(fewest - 1) > 0:
        fewest -= 1
    return speed, (fewest if speed(full_nodes) > 0 else None)


def price(plan: Plan, w: Workload, hw: Hardware, a: Assumptions, costs: CostModel, c: Constraints) -> Plan:
    """The plan with its full offerings: on demand, spot and mixed pools with spares and elastic shrink."""
    speed, fewest = elastic_shrink(w, plan.strategy, hw, a, c)
    work = plan.step.train_days * 86400
    offerings = run_cost(work, plan.strategy.gpus, plan.checkpoint_bytes, hw, costs, speed, fewest)
    return dataclasses.replace(plan, offerings=offerings)


def _rank_key(objective: Objective, deadline_s: float | None) -> Callable[[Plan], tuple]:
    """Throughput: fastest, then least memory. Cost: those that finish within the deadline first, then the
    cheapest, then the fastest."""
    if objective == "throughput":
        return lambda p: (-p.step.tokens_per_s, p.memory.total)
    return lambda p: (deadline_s is not None and p.cost.wall_s > deadline_s, p.cost.usd, -p.step.tokens_per_s)


def search(
    w: Workload,
    gpus: int | list[int],
    hw: Hardware,
    objective: Objective = "throughput",
    constraints: Constraints = Constraints(),
    a: Assumptions = DEFAULTS,
    costs: CostModel = DEFAULT_COSTS,
    memory_only: bool = False,
    priced: int = 10,
) -> SearchResult:
    """Evaluate every valid strategy on each device count in `gpus`; plans come back best first. The first
    `priced` (by the objective, on demand) also get spot, mixed and elastic offerings, and under the cost
    objective are re-ranked by the recommended pool's dollars. With memory_only, plans carry no step time or
    cost (used to find what would fit).

    Below CP_MIN_SEQ_LEN tokens a sequence, the search leaves context parallelism out unless the constraints
    name a cp or no layout without it fits: its terms are checked against no published run, and published
    practice uses it for long sequences only (docs/planner.md, "Context parallelism at short sequences")."""
    if constraints.cp is None and w.seq_len < CP_MIN_SEQ_LEN:
        result = search(w, gpus, hw, objective, dataclasses.replace(constraints, cp=1), a, costs, memory_only, priced)
        if result.plans:
            return result
    if w.model.n_experts and w.lora_rank:  # LoRA's formulas count a dense layer's projections
        raise PlannerError(
            f"the planner does not model LoRA on mixture-of-experts layers (model.n_experts={w.model.n_experts}, "
            f"lora rank {w.lora_rank}); plan full training, or choose the layout yourself (docs/moe.md)"
        )
    if constraints.recompute == "full" and constraints.recompute_layers:
        raise PlannerError(
            f"--recompute-layers {constraints.recompute_layers} recomputes some blocks fully, but --recompute full "
            "already recomputes all of them: use none, selective or mlp"
        )
    result = SearchResult()
    fits: dict[Candidate, bool] = {}  # whether each strategy as enumerated fits
    for n in [gpus] if isinstance(gpus, int) else gpus:
        limit = capacity(hw, n, constraints)
        sized: dict[Candidate, tuple[Memory, Memory, int]] = {}  # `_sized` by `memory_key`
        for item in enumerate_strategies(w, n, hw.gpus_per_node, constraints, a):
            if isinstance(item, Rejection):
                result.rejected.append(item)
                continue
            if item.recompute == "mlp" and fits.get(dataclasses.replace(item, recompute="none")):
                continue  # slower than keeping every activation, which fits (enumerated before it)
            shape = memory_key(item)
            if shape not in sized:
                sized[shape] = _sized(w, item, hw, a, limit, constraints)
            enumerated, mem, recompute_layers = sized[shape]
            fits[item] = enumerated.total <= limit
            if recompute_layers != item.recompute_layers:
                item = dataclasses.replace(item, recompute_layers=recompute_layers)
            if mem.total > limit:
                detail = f"needs {mem.total / GB:.1f} GiB > {limit / GB:.1f} GiB"
                result.rejected.append(Rejection(str(item), "out of memory", detail, mem))
            elif memory_only:
                result.plans.append(Plan(item, item.micro_batches(w.global_batch), mem, None, None))
            else:
                result.plans.append(plan_strategy(w, item, hw, a, costs, mem))
    if memory_only:
        result.plans.sort(key=lambda p: p.memory.total)
        return result
    key = _rank_key(objective, costs.deadline_s)
    result.plans.sort(key=key)
    head = [price(p, w, hw, a, costs, constraints) for p in result.plans[:priced]]
    result.plans[:priced] = sorted(head, key=key)
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
    """The top-ranked plan, or PlannerError saying why nothing works and what would."""
    result = search(w, gpus, hw, objective, constraints, a, costs, priced=1 if objective == "throughput" else 10)
    if not result.plans:
        raise PlannerError(no_fit_message(w, gpus, hw, constraints, a, result))
    return result.plans[0]


def fits_somehow(w: Workload, gpus: int, hw: Hardware, c: Constraints, a: Assumptions = DEFAULTS) -> bool:
    """Whether some strategy the constraints allow fits in memory on `gpus` devices (stops at the first;
    ring attention only, as in a memory-only search)."""
    limit = capacity(hw, gpus, c)
    ring = c if c.cp_attention else dataclasses.replace(c, cp_attention="ring")
    strategies = enumerate_strategies(w, gpus, hw.gpus_per_node, ring, a)
    return any(memory(w, s, hw, a).total <= limit for s in strategies if isinstance(s, Candidate))


def no_fit_message(
    w: Workload, gpus: int | list[int], hw: Hardware, c: Constraints, a: Assumptions, result: SearchResult
) -> str:
    """One line: why nothing works on these devices, and what would: the same device count with the fixed
    choices freed, else the smallest power-of-two multiple of it on which some layout fits (its fastest)."""
    n = gpus if isinstance(gpus, int) else max(gpus)
    oom = [r for r in result.rejected if r.memory is not None]
    if oom:
        smallest = min(oom, key=lambda r: r.memory.total)
        need, limit = smallest.memory.total / GB, capacity(hw, n, c) / GB
        msg = f"{w.name} does not fit on {n}× {hw.name}: smallest footprint {need:.1f} GiB > {limit:.1f} GiB"
        msg += f" per GPU ({smallest.layout})"
    else:
        first = result.rejected[0]
        msg = f"no valid layout for {w.name} on {n}× {hw.name}: {first.layout}: {first.reason} ({first.detail})"
        if len(result.rejected) > 1:
            msg += "; rejected: " + ", ".join(f"{r} ×{k}" for r, k in result.reasons().most_common(3))
    free = Constraints(uneven_layers=c.uneven_layers, memory_gb=c.memory_gb, recompute_options=c.recompute_options)
    m = n if free != c else 2 * n
    while m <= (MAX_GPUS if oom else n):  # more devices only help when memory is the problem
        if fits_somehow(w, m, hw, free, a):
            fastest = search(w, m, hw, constraints=free, a=a, priced=0).plans[0]
            example = f"{fastest.strategy} at {fastest.memory.total / GB:.1f} GiB/GPU"
            return f"{msg}; {'fits as' if m == n else f'needs ≥ {m} GPUs, e.g.'} {example}"
        m *= 2
    return f"{msg}; nothing fits on up to {MAX_GPUS} GPUs" if oom else msg


def plan_for_config(cfg: Config, world_size: int, calibration: dict | None = None) -> Candidate:
    """The fastest strategy for a meshlm run config on `world_size` ranks, for `--parallel.layout auto`.

    The device comes from the calibration (its `device`), else cpu, or the local GPU's table entry.
    Every recompute policy is the trainer's own (`train.recompute`, `train.recompute_layers`); the pipeline
    split is the trainer's."""
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
        cfg.lora.rank,
    )
    c = Constraints(micro_batch=cfg.train.micro_batch or None, recompute_options=("none", "selective", "mlp", "full"))
    return best(w, world_size, hw, constraints=c, a=Assumptions(fused_loss=cfg.train.fused_loss)).strategy


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
    raise PlannerError(f"no planner figures for GPU {name!r}; pass a calibration from `meshlm doctor`")
