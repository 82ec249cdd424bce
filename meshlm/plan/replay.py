"""Replay a spot capacity trace through the planner's model of a job, by Monte-Carlo over start offsets.

The job is the one `meshlm.plan.spot.estimate` prices: `work_s` failure-free seconds on a `Pool`, a
checkpoint every `interval_s` (the closed form's Young interval) costing `checkpoint_s`, every interruption
costing `restart_s + load_s` and the work since the last checkpoint, hardware failures at the per-GPU rate
on every training node. What the closed form averages, the replay plays out against the trace:

- a rigid job trains while at least `spot` of its spot slots are up; an elastic one while its nodes left
  are at least `min_nodes`, at `speed(nodes)`, and restarts once more to regrow when capacity returns;
- when the trace loses nodes, which of the live ones went is drawn at random: a job is interrupted only
  when one of its training nodes went (a lost spare costs nothing);
- live spot nodes and every on-demand node are billed while the run lasts.

With a deadline, spot and mixed pools follow the uniform-progress policy (Wu et al., "Can't Be Late",
NSDI 2024): whenever committed work lags the straight line from 0 to all of it at the deadline, the job
moves to on-demand nodes (one restart), and back to spot once it is ahead by a restart and an interval;
when only on demand can still make it, it stays there. Every run is seeded, so results are exact.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from meshlm.plan.spot import HOUR, Estimate, Offerings, Pool, Rates, duration_text, estimate
from meshlm.plan.traces import Trace

RUNS = 200
HORIZON = 20  # a run that has not finished within this many times its work never will
GIVE_UP = 10  # after this many unfinished runs and none finished, the rest are not played
MEETS = 0.9  # with a deadline, a pool is recommended on a trace when this share of its runs meets it


class ReplayError(ValueError):
    """A replay that cannot be asked (a deadline no pool can meet), in one line."""


@dataclass(frozen=True)
class Run:
    wall_s: float  # infinite when it did not finish within the horizon
    usd: float
    restarts: int
    training_s: float  # wall time spent with the job up (restarting, training, saving)


@dataclass(frozen=True)
class Replay:
    """Percentiles over runs of one pool on one trace, beside the closed form's expectation."""

    pool: Pool
    closed: Estimate
    runs: int
    finished: int
    wall_p50: float
    wall_p90: float
    usd_p50: float
    usd_p90: float
    restarts_p50: float
    restarts_p90: float
    reason: str = ""  # why spot cannot finish on this trace, or ""
    deadline_s: float | None = None
    met: float | None = None  # share of runs within the deadline
    usd_per_token: float | None = None  # median dollars per training token

    @property
    def feasible(self) -> bool:
        return self.finished > 0

    def to_dict(self) -> dict:
        def days(s: float) -> float | None:
            return s / 86400 if math.isfinite(s) else None

        def finite(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        return {
            "pool": self.pool.describe(),
            "runs": self.runs,
            "finished": self.finished,
            "wall_days_p50": days(self.wall_p50),
            "wall_days_p90": days(self.wall_p90),
            "cost_usd_p50": finite(self.usd_p50),
            "cost_usd_p90": finite(self.usd_p90),
            "restarts_p50": finite(self.restarts_p50),
            "restarts_p90": finite(self.restarts_p90),
            "closed_form_wall_days": days(self.closed.wall_s),
            "closed_form_cost_usd": finite(self.closed.usd),
            "met_deadline": self.met,
            "usd_per_token": finite(self.usd_per_token),
            "reason": self.reason,
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1]) of `values`; unfinished runs (inf) sort last."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _Job:
    """One run: a state machine advanced from event to event (trace changes, failures, phase ends)."""

    def __init__(self, work_s: float, pool: Pool, rates: Rates, trace: Trace, interval_s: float,
                 speed: Callable[[int], float] | None, rng: random.Random,
                 deadline_s: float | None, od_factor: float, od_interval_s: float = 0.0) -> None:  # fmt: skip
        self.work, self.pool, self.r, self.trace, self.tau = work_s, pool, rates, trace, interval_s
        self.od_tau = od_interval_s or interval_s  # on demand for good checkpoints at its own interval
        self.speed, self.rng, self.deadline, self.od_factor = speed, rng, deadline_s, od_factor
        self.slots = pool.spot + pool.spares
        self.on_demand = pool.nodes - pool.spot
        self.restart_s = rates.restart_s + rates.load_s
        self.failure = rates.failure_per_gpu_hour / HOUR * pool.gpus_per_node
        self.od_mode = self.locked = False
        self.restarts, self.usd, self.training = 0, 0.0, 0.0

    def nodes(self, live: int) -> int:
        """Training nodes the job would run on with `live` spot nodes up (0: it cannot run)."""
        if self.od_mode:
            return self.pool.nodes
        n = self.on_demand + min(live, self.pool.spot)
        if self.pool.elastic and self.speed is not None:
            return n if n >= self.pool.min_nodes and self.speed(n) > 0 else 0
        return n if live >= self.pool.spot else 0

    def rate(self, n: int) -> float:
        if self.od_mode or not (self.pool.elastic and self.speed is not None):
            return 1.0
        return self.speed(n)

    def behind(self, t: float, committed: float) -> bool:
        return self.deadline is not None and committed < self.work * t / self.deadline

    def play(self, start: float, horizon_s: float) -> Run:
        """The run from `start` into the trace. Runs step through millions of trace ticks, so the loop reads
        locals and skips `_capacity` where a tick cannot change anything (the same nodes up, not waiting)."""
        trace, r, g, pool = self.trace, self.r, self.pool.gpus_per_node, self.pool
        times, ends, lives, caps = trace.times, trace.ends, trace.lives(self.slots), trace.capacity(self.slots)
        ticks, expovariate, elastic = len(times), self.rng.expovariate, pool.elastic
        k = trace.index(start)
        seg_end = ends[k] - start
        live, cap = lives[k], caps[k]
        if self.deadline is not None and pool.spot and self.must_lock(0.0, 0.0):
            self.od_mode = self.locked = True  # only on demand can make it: start there
        n = self.nodes(live)
        phase = "work" if n else "wait"  # the first start costs no restart (as in Daly's model)
        left = 0.0  # seconds left in a restart or a save
        t = committed = chunk = 0.0
        while committed < self.work and t < horizon_s:
            if phase == "work":
                target = min(self.od_tau if self.locked else self.tau, self.work - committed)
                rate = self.rate(n)
                end = t + (target - chunk) / rate
            elif phase == "wait":  # with a deadline the policy looks again every interval while waiting
                end = t + self.tau if self.deadline is not None else math.inf
            else:
                end = t + left
            fail_rate = self.failure * n if phase != "wait" else 0.0
            fail = t + expovariate(fail_rate) if fail_rate > 0 else math.inf
            tn = seg_end if seg_end <= end and seg_end <= fail else (end if end <= fail else fail)
            dt = tn - t
            billed_spot = 0 if self.od_mode else live
            self.usd += dt * g * (self.on_demand_billed() * r.price_on_demand + billed_spot * r.price_spot) / HOUR
            if phase != "wait":
                self.training += dt
            if phase == "work":
                chunk += dt * rate
            elif phase != "wait":
                left -= dt
            t = tn
            if tn == fail:
                phase, left, chunk, n = self._interrupt(live)
            elif tn == end:
                if phase == "wait":
                    phase, left, n = self._policy(t, committed, live, n, phase)
                elif phase == "restart":
                    phase, chunk = "work", 0.0
                elif phase == "work":
                    phase, left, chunk = "save", r.checkpoint_s, target
                else:
                    committed += chunk
                    phase, chunk = "work", 0.0
                    phase, left, n = self._policy(t, committed, live, n, phase)
            else:
                k = (k + 1) % ticks
                seg_end = t + ends[k] - times[k]
                before, live, cap_before, cap = live, lives[k], cap, caps[k]
                if live != before or cap < cap_before or phase == "wait" or elastic:
                    lost = (cap_before, cap_before - cap)
                    phase, left, chunk, n = self._capacity(before, live, phase, left, chunk, n, lost)
                if phase == "wait" and self.deadline is not None:
                    phase, left, n = self._policy(t, committed, live, n, phase)
        wall = t if committed >= self.work else math.inf
        return Run(wall, self.usd, self.restarts, self.training)

    def on_demand_billed(self) -> int:
        return self.pool.nodes if self.od_mode else self.on_demand

    def _interrupt(self, live: int) -> tuple[str, float, float, int]:
        """Lose the work since the last checkpoint; restart now if the job can run, else wait."""
        self.restarts += 1
        n = self.nodes(live)
        return ("restart" if n else "wait"), self.restart_s, 0.0, n

    def _capacity(self, before: int, live: int, phase: str, left: float, chunk: float, n: int,
                  lost: tuple[int, int]):  # fmt: skip
        """The pool changed from `before` to `live` spot nodes up; `lost`: (nodes the trace had up, nodes it
        lost), each lost one of this pool's live nodes with probability (pool's live)/(trace's live)."""
        if self.od_mode:
            return phase, left, chunk, n
        if phase == "wait":
            n = self.nodes(live)
            if not n:
                return phase, left, chunk, 0
            return ("restart", self.restart_s, 0.0, n) if self.started else ("work", 0.0, 0.0, n)
        active = min(before, self.pool.spot)
        up, gone = lost
        if gone > 0:
            hit = False
            for _ in range(gone):  # which of the trace's live nodes went: any of them, equally likely
                if self.rng.random() < active / up:
                    hit = True
                    break
                up -= 1
            if hit:
                return self._interrupt(live)
        elif self.pool.elastic and self.nodes(live) > n:
            return self._interrupt(live)  # regrow onto the nodes that came back
        return phase, left, chunk, n

    @property
    def started(self) -> bool:
        return self.restarts > 0 or self.training > 0

    def must_lock(self, t: float, committed: float) -> bool:
        """Only on demand can still make it: its time for the rest, a switch, and one interval before the
        policy looks again reach the deadline."""
        remaining = (self.work - committed) * self.od_factor + 2 * self.restart_s + self.tau + self.r.checkpoint_s
        return t + remaining >= self.deadline

    def _policy(self, t: float, committed: float, live: int, n: int, phase: str) -> tuple[str, float, int]:
        """Uniform progress: on demand while behind the line (for good once only on demand can make it),
        back to spot when ahead by a restart and an interval and spot can run."""
        if self.deadline is None or self.pool.spot == 0:
            return phase, 0.0, n
        if not self.locked and self.must_lock(t, committed):
            self.locked = True
        if not self.od_mode and (self.locked or self.behind(t, committed)):
            self.od_mode = True
            self.restarts += 1
            return "restart", self.restart_s, self.pool.nodes
        ahead = committed - self.work * t / self.deadline
        if self.od_mode and not self.locked and ahead >= 2 * self.restart_s + self.tau:
            self.od_mode = False
            spot_n = self.nodes(live)
            if spot_n:
                self.restarts += 1
                return "restart", self.restart_s, spot_n
            self.od_mode = True
        return phase, 0.0, n


def replay(
    work_s: float,
    pool: Pool,
    rates: Rates,
    trace: Trace,
    speed: Callable[[int], float] | None = None,
    runs: int = RUNS,
    seed: int = 0,
    deadline_s: float | None = None,
    tokens: float | None = None,
) -> Replay:
    """Play `runs` runs of the job on `pool` against `trace`, each from a random start offset (seeded), and
    summarise them beside `estimate(work_s, pool, rates, speed)`. With `deadline_s`, spot and mixed pools
    fall back to on demand by uniform progress; `tokens` (the run's training tokens) prices a token."""
    closed = estimate(work_s, pool, rates, speed)
    on_demand = estimate(work_s, Pool(pool.nodes, pool.gpus_per_node), rates)
    interval = closed.interval_s or on_demand.interval_s
    slots = pool.spot + pool.spares
    probe = _Job(work_s, pool, rates, trace, interval, speed, random.Random(0), None, 1.0)
    if pool.spot and not probe.nodes(trace.most(slots)):
        need = f"{pool.min_nodes} of {pool.nodes} nodes" if pool.elastic else f"{pool.spot} spot nodes"
        reason = (f"spot cannot finish on {trace.source}: it never has {need} up together (at most "
                  f"{trace.most(slots)} of {slots} spot slots)")  # fmt: skip
        if deadline_s is not None:
            reason += "; the deadline policy would run it on demand throughout (the on-demand row)"
        return _summary(pool, closed, [], runs, reason, deadline_s, tokens)
    od_factor = on_demand.wall_s / work_s  # on demand's pace, at its own checkpoint interval (once locked there)
    starts = random.Random(seed)
    horizon = HORIZON * work_s / (closed.speed if closed.feasible and closed.speed > 0 else 1.0)
    played: list[Run] = []
    for i in range(runs):
        offset = starts.uniform(0, trace.duration_s)
        rng = random.Random(f"{seed}:{i}")
        job = _Job(work_s, pool, rates, trace, interval, speed, rng, deadline_s, od_factor, on_demand.interval_s)
        played.append(job.play(offset, horizon))
        if i + 1 >= GIVE_UP and not any(math.isfinite(p.wall_s) for p in played):
            break
    reason = ""
    if not any(math.isfinite(p.wall_s) for p in played):
        restarts = sum(p.restarts for p in played)
        every = sum(p.training_s for p in played) / restarts if restarts else math.inf
        reason = (f"spot cannot finish on {trace.source}: none of {len(played)} runs did {duration_text(work_s)} of "
                  f"work within {duration_text(horizon)}; an interruption every {duration_text(every)} while up, "
                  f"against a restart plus a checkpoint ({duration_text(probe.restart_s)} + "
                  f"{duration_text(rates.checkpoint_s)})")  # fmt: skip
    return _summary(pool, closed, played, runs, reason, deadline_s, tokens)


def _summary(pool: Pool, closed: Estimate, played: list[Run], runs: int, reason: str,
             deadline_s: float | None, tokens: float | None) -> Replay:  # fmt: skip
    if not played:
        inf = math.inf
        return Replay(pool, closed, runs, 0, inf, inf, inf, inf, inf, inf, reason, deadline_s,
                      0.0 if deadline_s else None, None)  # fmt: skip
    walls = [p.wall_s for p in played]
    usd = [p.usd if math.isfinite(p.wall_s) else math.inf for p in played]
    restarts = [float(p.restarts) if math.isfinite(p.wall_s) else math.inf for p in played]
    met = sum(w <= deadline_s for w in walls) / len(walls) if deadline_s is not None else None
    usd50 = percentile(usd, 0.5)
    return Replay(
        pool, closed, len(played), sum(math.isfinite(w) for w in walls), percentile(walls, 0.5),
        percentile(walls, 0.9), usd50, percentile(usd, 0.9), percentile(restarts, 0.5), percentile(restarts, 0.9),
        reason, deadline_s, met, usd50 / tokens if tokens else None,
    )  # fmt: skip


@dataclass(frozen=True)
class Replays:
    """A plan's offerings replayed: on demand, spot and mixed (None for a one-node job)."""

    on_demand: Replay
    spot: Replay
    mixed: Replay | None
    fitted: tuple[float, float] = (0.0, 0.0)  # the trace's preemptions per node-hour and mean time away (s)
    assumed: tuple[float, float] = (0.0, 0.0)  # the closed form's (Rates.preemption_per_node_hour, replace_s)

    @property
    def recommended(self) -> Replay:
        """The pool to run on this trace: the cheapest median cost among those that finish (with a deadline,
        in at least `MEETS` of runs within it); on demand when none does."""
        pools = [rp for rp in (self.on_demand, self.spot, self.mixed) if rp is not None and rp.feasible]
        pools = [rp for rp in pools if rp.met is None or rp.met >= MEETS]
        return min(pools, key=lambda rp: (rp.usd_p50, rp.wall_p50), default=self.on_demand)

    def to_dict(self) -> dict:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "recommended": self.recommended.pool.describe(),
            "on_demand": self.on_demand.to_dict(),
            "spot": self.spot.to_dict(),
            "mixed": self.mixed.to_dict() if self.mixed else None,
            "trace_preemptions_per_node_hour": finite(self.fitted[0]),
            "trace_replace_s": finite(self.fitted[1]),
            "closed_form_preemptions_per_node_hour": self.assumed[0],
            "closed_form_replace_s": self.assumed[1],
        }


def check_deadline(deadline_s: float, on_demand: Estimate, of: str = "") -> None:
    """A deadline shorter than the on-demand wall time cannot be met by any pool (spot and mixed pools are
    never faster): one line naming `--deadline` and what is valid."""
    if deadline_s < on_demand.wall_s:
        least = duration_text(on_demand.wall_s)
        raise ReplayError(
            f"--deadline {duration_text(deadline_s)} is shorter than the on-demand wall time{of} {least}: no pool "
            f"can meet it; valid: at least {least}"
        )


def replay_offerings(
    work_s: float,
    offers: Offerings,
    rates: Rates,
    trace: Trace,
    speed: Callable[[int], float] | None = None,
    runs: int = RUNS,
    seed: int = 0,
    deadline_s: float | None = None,
    tokens: float | None = None,
) -> Replays:
    """Replay the on-demand, spot and mixed pools `compare` chose (with the deadline policy if given), with
    the preemption rate and time away the trace shows for the spot pool's slots beside the closed form's."""
    if deadline_s is not None:
        check_deadline(deadline_s, offers.on_demand)

    def one(e: Estimate) -> Replay:
        return replay(work_s, e.pool, rates, trace, speed, runs, seed, deadline_s, tokens)

    fitted = trace.fitted()
    return Replays(one(offers.on_demand), one(offers.spot), one(offers.mixed) if offers.mixed else None, fitted,
                   (rates.preemption_per_node_hour, rates.replace_s))  # fmt: skip
