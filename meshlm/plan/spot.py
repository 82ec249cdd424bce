"""Wall time, dollars and restarts of one training job on a pool of on-demand and spot nodes.

A job trains on `nodes` nodes. `spot` of them are spot nodes, each preempted at a per-node rate and back
after a mean replacement time; `spares` more spot nodes wait to replace a preempted one at once; an elastic
job (`min_nodes`) keeps training on the nodes that are left instead of waiting for all of them. Every
interruption (a preemption of a training node, a hardware failure, and for an elastic job the regrow once
capacity is back) costs a restart and the work since the last checkpoint (Young 1974, Daly 2006). Used by
`meshlm plan` for every listed layout; `estimate` and `compare` are the API for other planners (spot traces,
SkyPilot). Formulas and their approximations: docs/planner.md, "Spot and failures".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

HOUR = 3600.0
MIN_AVAILABILITY = 0.01  # a pool whose training nodes are all up less often than this never gets going
SPOT_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)  # mixed pools tried by `compare`


@dataclass(frozen=True)
class Pool:
    """The nodes a job runs on. `spot` of the `nodes` training nodes are spot (the rest on demand); `spares`
    extra spot nodes stand by; an elastic job (`min_nodes` < nodes) trains on as few as `min_nodes`."""

    nodes: int
    gpus_per_node: float  # a job smaller than a node counts the GPUs it uses
    spot: int = 0
    spares: int = 0
    min_nodes: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes

    def describe(self) -> str:
        """'on demand', 'spot', 'spot 384/1024 nodes', with ', 4 spares' and ', elastic 512–1024 nodes'."""
        if not self.spot:
            kind = "on demand"
        else:
            kind = "spot" if self.spot == self.nodes else f"spot {self.spot}/{self.nodes} nodes"
        spares = f", {self.spares} spare{'s' if self.spares > 1 else ''}" if self.spares else ""
        elastic = f", elastic {self.min_nodes}–{self.nodes} nodes" if self.elastic else ""
        return kind + spares + elastic


@dataclass(frozen=True)
class Rates:
    """Interruption rates, times and prices (per GPU-hour) that price a pool."""

    failure_per_gpu_hour: float  # hardware interruptions, every node
    preemption_per_node_hour: float  # spot nodes
    replace_s: float  # mean time until a preempted spot node is back
    restart_s: float  # reschedule and re-initialise, besides loading the checkpoint
    checkpoint_s: float  # δ: writing one checkpoint
    load_s: float  # reading it back on a restart
    price_on_demand: float
    price_spot: float


@dataclass(frozen=True)
class Estimate:
    """Expected outcome of a job on one pool; wall_s is infinite, and `reason` says why, when it cannot finish."""

    pool: Pool
    wall_s: float
    usd: float
    restarts: float
    interval_s: float  # checkpoint interval (Young)
    mtbi_s: float  # mean time between interruptions while training
    availability: float  # fraction of the wall time the pool can train
    speed: float  # mean throughput while training, relative to the full layout
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.wall_s)

    def to_dict(self) -> dict:
        """JSON-ready; an infinite value (a job that cannot finish) becomes None."""
        out = {
            "pool": self.pool.describe(),
            "nodes": self.pool.nodes,
            "spot_nodes": self.pool.spot,
            "spares": self.pool.spares,
            "min_nodes": self.pool.min_nodes if self.pool.elastic else self.pool.nodes,
            "wall_days": self.wall_s / 86400,
            "cost_usd": self.usd,
            "restarts": self.restarts,
            "checkpoint_interval_s": self.interval_s,
            "mtbi_s": self.mtbi_s,
            "availability": self.availability,
            "speed": self.speed,
            "reason": self.reason,
        }
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in out.items()}


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Optimal time between checkpoints, sqrt(2·δ·MTBF) (Young 1974)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_wall_time(
    solve_s: float, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float
) -> float:
    """Expected wall time of `solve_s` seconds of work checkpointed every `interval_s` under Poisson
    failures: M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ (Daly 2006). Infinite when failures outpace it."""
    if math.isinf(mtbf_s):
        return solve_s + checkpoint_s * solve_s / interval_s
    exponent = (restart_s + interval_s + checkpoint_s) / mtbf_s
    if exponent > 700:
        return math.inf
    return (
        mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) * solve_s / interval_s
    )


@lru_cache(maxsize=256)
def _live(slots: int, up: float) -> tuple[float, ...]:
    """P(L live of `slots` spot nodes), L = 0..slots, each up with probability `up` (binomial)."""
    if up >= 1.0:
        return (0.0,) * slots + (1.0,)
    log_up, log_down = math.log(up), math.log1p(-up)
    lg = math.lgamma(slots + 1)
    return tuple(
        math.exp(lg - math.lgamma(k + 1) - math.lgamma(slots - k + 1) + k * log_up + (slots - k) * log_down)
        for k in range(slots + 1)
    )


def duration_text(seconds: float) -> str:
    """'2.5 d', '3.59 min', '42 s': the largest unit that fits, 3 significant digits."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def estimate(work_s: float, pool: Pool, rates: Rates, speed: Callable[[int], float] | None = None) -> Estimate:
    """Expected wall time, dollars and restarts of `work_s` failure-free seconds on the full pool.

    A spot slot holds a live node a fraction up = μ/(λ + μ) of the time (preemption rate λ, return rate
    μ = 1/replace_s), so L live nodes of the spot + spares slots are binomial. A rigid job trains while
    L ≥ spot; an elastic one while the nodes left (on demand + min(L, spot)) are at least `min_nodes`, at
    `speed(nodes)` of the full layout's throughput. Interruptions while training: hardware failures on every
    node, preemptions of training spot nodes, and for an elastic job a regrow each time a node comes back
    while it runs shrunk (the flow (slots − k)·μ out of each running state k < spot). The training time
    follows Daly with the Young interval; the wall time divides it by the fraction of time the pool can
    train. Live spot nodes and all on-demand nodes are billed for the whole wall time."""
    g, nodes = pool.gpus_per_node, pool.nodes
    on_demand = nodes - pool.spot
    preempt = rates.preemption_per_node_hour / HOUR
    up = 1.0 if pool.spot == 0 or preempt == 0 else 1 / (1 + preempt * rates.replace_s)
    live = _live(pool.spot + pool.spares, up)
    if pool.elastic and speed is not None:
        likely = [k for k, p in enumerate(live) if p > 1e-12]  # the binomial's mass sits near its mean
        running = [k for k in likely if on_demand + min(k, pool.spot) >= pool.min_nodes]
        availability = sum(live[k] for k in running)
        norm = availability or 1.0
        relative = sum(live[k] * speed(on_demand + min(k, pool.spot)) for k in running) / norm
        active = sum(live[k] * min(k, pool.spot) for k in running) / norm
        # a node back while the job runs shrunk regrows it: (slots − k)·μ per running state k < spot (a
        # return that lifts a stopped job to min_nodes is its restart, already counted by the preemption)
        back = 1 / rates.replace_s if rates.replace_s > 0 else 0.0
        regrows = sum(live[k] * (len(live) - 1 - k) * back for k in running if k < pool.spot) / norm
        preemptions = preempt * active + regrows
    else:
        availability = sum(live[pool.spot :])
        relative, preemptions = 1.0, preempt * pool.spot
    interruptions = rates.failure_per_gpu_hour / HOUR * g * nodes + preemptions
    mtbi = 1 / interruptions if interruptions > 0 else math.inf
    restart = rates.restart_s + rates.load_s
    billed = g * (on_demand * rates.price_on_demand + (pool.spot + pool.spares) * up * rates.price_spot) / HOUR

    def never(reason: str) -> Estimate:
        usd = math.inf if billed else 0.0
        return Estimate(pool, math.inf, usd, math.inf, 0.0, mtbi, availability, relative, reason)

    if availability < MIN_AVAILABILITY:
        need = f"{pool.min_nodes} of {nodes}" if pool.elastic else f"all {pool.spot} spot"
        return never(
            f"{need} nodes are up together only {availability:.2%} of the time (each spot node is preempted every "
            f"{duration_text(1 / preempt)} and away {duration_text(rates.replace_s)})"
        )
    if mtbi < restart + rates.checkpoint_s:
        return never(
            f"one interruption every {duration_text(mtbi)} ({pool.spot} spot nodes × {preempt * HOUR:.3g} preemptions"
            f"/node-hour{' + regrows' if pool.elastic else ''} + failures), shorter than a restart plus one "
            f"checkpoint ({duration_text(restart)} + {duration_text(rates.checkpoint_s)}); spares and elastic "
            "shrink only save the wait for capacity, every preemption of a training node still restarts the job"
        )
    work = work_s / relative
    interval = min(young_interval(rates.checkpoint_s, mtbi), work)
    training = expected_wall_time(work, interval, rates.checkpoint_s, restart, mtbi)
    if math.isinf(training):
        return never(f"restarts every {duration_text(mtbi)} outpace checkpoints every {duration_text(interval)}")
    wall = training / availability
    return Estimate(pool, wall, wall * billed, training / mtbi, interval, mtbi, availability, relative)


@dataclass(frozen=True)
class Offerings:
    """A job priced three ways: all on demand, the best all-spot pool, the best mixed pool; `recommended` is
    the cheapest that finishes (within the deadline, if any). Every note says why an offering that costs or
    takes more than on demand does, or why nothing meets the deadline; "" where there is nothing to explain."""

    on_demand: Estimate
    spot: Estimate
    mixed: Estimate | None  # None for a one-node job
    recommended: Estimate
    note: str
    spot_note: str
    mixed_note: str

    def to_dict(self) -> dict:
        return {
            "on_demand": self.on_demand.to_dict(),
            "spot": self.spot.to_dict() | {"note": self.spot_note},
            "mixed": self.mixed.to_dict() | {"note": self.mixed_note} if self.mixed else None,
            "recommended": self.recommended.pool.describe(),
            "note": self.note,
        }


@dataclass(frozen=True)
class Shapes:
    """Which pools a launcher can run, so only those are priced: mixed spot + on-demand nodes, hot spares,
    elastic shrink (meshlm.plan.emit.TARGET_SHAPES)."""

    mixed: bool = True
    spares: bool = True
    elastic: bool = True


ALL_SHAPES = Shapes()


def _pools(nodes: int, g: float, spot: int, min_nodes: int | None, shapes: Shapes = ALL_SHAPES) -> list[Pool]:
    """The pools with `spot` spot nodes worth pricing: no spares or powers of two up to a quarter of the
    nodes, rigid or (given a smallest layout) elastic, as far as `shapes` allows."""
    spares = [0, *(2**k for k in range(max(1, nodes // 4).bit_length()))] if shapes.spares else [0]
    elastic = shapes.elastic and min_nodes is not None and min_nodes < nodes
    return [Pool(nodes, g, spot, s, m) for s in spares for m in [None] + ([min_nodes] if elastic else [])]


def _why_not(choice: Estimate, on_demand: Estimate) -> str:
    """Why a spot-using estimate costs or takes more than on demand; "" when it does neither."""
    if not choice.feasible:
        return f"spot cannot finish this job: {choice.reason}"
    dearer, slower = choice.usd > on_demand.usd, choice.wall_s > on_demand.wall_s * 1.0005
    if not (dearer or slower):
        return ""
    causes = [f"{choice.restarts:,.0f} restarts (one every {duration_text(choice.mtbi_s)}, against "
              f"{on_demand.restarts:,.0f} on demand)"]  # fmt: skip
    if choice.availability < 0.995:
        causes.append(f"{1 - choice.availability:.0%} of the time waiting for spot capacity")
    if choice.speed < 0.995:
        causes.append(f"training shrunk to {choice.speed:.0%} of full speed on average")
    longer = duration_text(choice.wall_s - on_demand.wall_s)
    verdict = (
        f"costs ${choice.usd:,.0f} against ${on_demand.usd:,.0f} on demand"
        if dearer
        else f"saves ${on_demand.usd - choice.usd:,.0f} but takes {longer} longer"
    )
    return f"{choice.pool.describe()} {verdict} ({duration_text(choice.wall_s)}): " + ", ".join(causes)


def compare(
    work_s: float,
    nodes: int,
    gpus_per_node: float,
    rates: Rates,
    speed: Callable[[int], float] | None = None,
    min_nodes: int | None = None,
    deadline_s: float | None = None,
    shapes: Shapes = ALL_SHAPES,
) -> Offerings:
    """Price a job on demand, all spot and mixed (`SPOT_SHARES` of the nodes on spot), each with the spares and
    elastic shrink (to `min_nodes`, at `speed(nodes)`) that make it cheapest, and recommend the cheapest that
    finishes within `deadline_s`; only the pools `shapes` allows (a launcher's). Where no pool of a kind
    finishes, the one that came closest (most available, then most spares) gives the reason."""
    g = gpus_per_node
    on_demand = estimate(work_s, Pool(nodes, g), rates, speed)

    def in_time(e: Estimate) -> bool:
        return e.feasible and (deadline_s is None or e.wall_s <= deadline_s)

    def cheapest(pools: list[Pool]) -> Estimate:
        found = [estimate(work_s, p, rates, speed) for p in pools]
        if ok := [e for e in found if e.feasible]:
            return min(ok, key=lambda e: (not in_time(e), e.usd, e.wall_s))
        return max(found, key=lambda e: (e.availability, e.pool.spares, e.pool.elastic))

    spot = cheapest(_pools(nodes, g, nodes, min_nodes, shapes))
    shares = sorted({round(f * nodes) for f in SPOT_SHARES} - {0, nodes}) if shapes.mixed else []
    mixed = cheapest([p for k in shares for p in _pools(nodes, g, k, min_nodes, shapes)]) if shares else None
    meets = [e for e in (on_demand, spot, mixed) if e is not None and in_time(e)]
    recommended = min(meets, key=lambda e: (e.usd, e.wall_s)) if meets else on_demand
    spot_note, mixed_note = _why_not(spot, on_demand), _why_not(mixed, on_demand) if mixed else ""
    note = ""
    if not meets:
        note = f"nothing finishes within {duration_text(deadline_s)}; on demand takes {duration_text(on_demand.wall_s)}"
    elif recommended is on_demand:
        note = "on demand is cheapest: " + "; ".join(n for n in (spot_note, mixed_note) if n)
    else:
        note = spot_note if recommended is spot else mixed_note
    return Offerings(on_demand, spot, mixed, recommended, note, spot_note, mixed_note)
