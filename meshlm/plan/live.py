"""Live recovery against checkpoint restart: what a preemption costs a job run as N fault-tolerant replica
groups (torchft's lighthouse and quorum, docs/fault-tolerance.md), priced term by term and replayed on the same
spot traces as the restart model (`meshlm.plan.replay`), with a recommendation of one.

A preemption that kills one of N groups costs the job, in seconds of the whole job's work:

- **detection**: the survivors' in-flight collective fails on the dead peer's reset connection
  (`DETECT_S`);
- **re-quorum**: the lighthouse drops the dead group after min(join, heartbeat timeout) with 3 or more
  groups, after the heartbeat timeout with 2 (its split-brain rule wants more than half of the healthy
  members: 1 of 2 is not) — the survivors make no progress meanwhile;
- **one redone step**: the step in flight is committed by nobody and redone at the smaller count;
- **the lost fraction of throughput while the group is down**: the survivors train at (N − 1)/N of the
  job's throughput (a smaller global batch, the same step time) while the group relaunches
  (`start-up`, the same re-initialisation a restarted job pays, `Rates.restart_s`) and heals from a peer
  (state bytes per rank / `HEAL_BPS`, every rank of the group fetching its own shard at once), plus any wait
  for a node to relaunch on: (start-up + heal) / N.

A checkpoint restart costs the existing model's: a whole-job restart (`restart_s + load_s`) and the work
since the last checkpoint. Live recovery falls back to exactly that when every group is down at once (no live
peer holds the state). The constants are the torchft probe's measurements on this project's machine
(/work/notes/ftprobe.md §4, torchft-nightly 2026.10.26, gloo) and the lighthouse timeouts of
`meshlm lighthouse` (docs/fault-tolerance.md, "Launching replica groups").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from meshlm.plan.memory import Candidate
from meshlm.plan.replay import HORIZON, RUNS, Replay, Run, _summary
from meshlm.plan.search import Plan
from meshlm.plan.spot import HOUR, Estimate, Pool, Rates, duration_text
from meshlm.plan.table import si
from meshlm.plan.traces import Trace

# kill -9 of a group: the survivors' gloo collective fails with "Connection reset by peer" 0.28-0.46 s after
# it (ftprobe §4, five runs); the upper end. A host that vanishes without a reset is found by the collective
# timeout instead (the ladder in docs/fault-tolerance.md), which this does not price.
DETECT_S = 0.46
LIGHTHOUSE_JOIN_TIMEOUT_S = 3.0  # `meshlm lighthouse --join-timeout-s 3` (measured re-quorum with 3 groups: 3.5-4.5 s)
HEARTBEAT_TIMEOUT_S = 5.0  # `--heartbeat-timeout-s 5` (measured with 2 groups: 5.4-5.7 s)
# torchft's HTTPTransport between two processes: 295 MB/s for a 256 MB state (ftprobe §2, heal_bw.py; 350-400 MB/s
# in other runs): serialisation-bound, below any data-centre link, so it, not the network, bounds a heal
HEAL_BPS = 295e6
LIGHTHOUSE_PORT = 29510


class LiveError(ValueError):
    """Replica groups that cannot be planned, in one line."""


@dataclass(frozen=True)
class FaultCost:
    """The terms of one group's loss, in seconds (see the module docstring)."""

    groups: int
    detect_s: float
    requorum_s: float
    redo_s: float  # one step
    startup_s: float  # the group's relaunch: scheduling, start-up, model build
    heal_s: float  # state bytes per rank / HEAL_BPS

    @property
    def stall_s(self) -> float:
        """Seconds in which no group makes progress: detection and re-quorum."""
        return self.detect_s + self.requorum_s

    @property
    def down_s(self) -> float:
        """Seconds the lost group is away once it has a node: start-up and heal."""
        return self.startup_s + self.heal_s

    @property
    def total_s(self) -> float:
        """Seconds of the whole job's work one loss costs when a node is at hand to relaunch on."""
        return self.stall_s + self.redo_s + self.down_s / self.groups


def requorum_s(
    groups: int, join_s: float = LIGHTHOUSE_JOIN_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_TIMEOUT_S
) -> float:
    """How long the lighthouse takes to form a quorum without a dead group: min(join, heartbeat) with ≥ 3
    groups, the heartbeat timeout with 2 (more than half of the healthy members must ask: 1 of 2 is not)."""
    return min(join_s, heartbeat_s) if groups >= 3 else heartbeat_s


def fault_cost(groups: int, step_s: float, state_bytes_per_rank: float, startup_s: float) -> FaultCost:
    """The cost of losing one of `groups` replica groups (module docstring)."""
    if groups < 2:
        raise LiveError(f"--replica-groups {groups}: live recovery needs at least 2 groups (one keeps training)")
    return FaultCost(groups, DETECT_S, requorum_s(groups), step_s, startup_s, state_bytes_per_rank / HEAL_BPS)


def restart_cost_s(rates: Rates, interval_s: float) -> float:
    """What one interruption costs a checkpoint-restarted job on average: the restart and reading the checkpoint
    back, plus half an interval of work since the last save (Poisson interruptions land uniformly in it)."""
    return rates.restart_s + rates.load_s + interval_s / 2


class _LiveJob:
    """One run of a job as `groups` replica groups of `pool.nodes / groups` nodes each, against a trace: a
    lost node takes its group down (the others go on at a smaller count); the group relaunches on any free
    node of the pool (a spare, a node back) and heals from a peer; with every group down at once the job
    restarts from its last checkpoint, as the restart model's does."""

    def __init__(self, work_s: float, pool: Pool, rates: Rates, trace: Trace, interval_s: float, cost: FaultCost,
                 rng: random.Random) -> None:  # fmt: skip
        self.work, self.pool, self.r, self.trace, self.tau, self.cost = work_s, pool, rates, trace, interval_s, cost
        self.rng, self.n = rng, cost.groups
        self.per_group = pool.nodes // cost.groups
        self.slots = pool.spot + pool.spares
        self.on_demand = pool.nodes - pool.spot
        self.failure = rates.failure_per_gpu_hour / HOUR * pool.gpus_per_node  # per node-second
        self.restarts = 0  # whole-job restarts from a checkpoint
        self.running, self.waiting, self.ready = 0, 0, []  # groups training / without nodes / relaunch ends

    def free(self, live: int) -> int:
        """Nodes up that no group holds."""
        return self.on_demand + live - self.per_group * (self.running + len(self.ready))

    def _place(self, t: float, live: int) -> None:
        """Relaunch waiting groups while nodes are free: each heals from a live peer; with none, the first
        restarts the job from its checkpoint (a whole-job restart) and the others heal from it once it is up."""
        while self.waiting and self.free(live) >= self.per_group:
            self.waiting -= 1
            if not self.started:
                self.ready.append(t)
            elif self.running:
                self.ready.append(t + self.cost.down_s)
            elif not self.ready:
                self.restarts += 1
                self.ready.append(t + self.r.restart_s + self.r.load_s)
            else:
                self.ready.append(max(t + self.cost.down_s, self.ready[0] + self.cost.heal_s))
            self.ready.sort()

    def _lose(self, running: bool) -> None:
        """A group goes down: a running one, or one still relaunching."""
        if running:
            self.running -= 1
        else:
            self.ready.pop(self.rng.randrange(len(self.ready)))
        self.waiting += 1
        if not self.running and self.started:  # no live replica holds the state: back to the checkpoint
            self.waiting += len(self.ready)
            self.ready = []

    def play(self, start: float, horizon_s: float) -> Run:
        """The run from `start` into the trace: the event loop of `replay._Job.play` (trace ticks, failures,
        phase ends) with groups. Phases: `save` (δ, every interval of work), `stall` (a loss's detection and
        re-quorum), `work` at running/N of the job's throughput, `idle` (no group up)."""
        trace, r, g = self.trace, self.r, self.pool.gpus_per_node
        times, ends, lives, caps = trace.times, trace.ends, trace.lives(self.slots), trace.capacity(self.slots)
        ticks, k = len(times), trace.index(start)
        seg_end, live, cap = ends[k] - start, lives[k], caps[k]
        self.waiting, self.started = self.n, False
        self._place(0.0, live)
        t = committed = chunk = left = 0.0
        phase = "work"
        usd = training = 0.0
        while committed < self.work and t < horizon_s:
            rate = self.running / self.n
            if not self.running:
                phase, end = "idle", math.inf
            elif phase == "work":
                end = t + (min(self.tau, self.work - committed) - chunk) / rate
            else:
                end = t + left
            ready = self.ready[0] if self.ready else math.inf
            fail_rate = self.failure * self.per_group * self.running
            fail = t + self.rng.expovariate(fail_rate) if fail_rate > 0 else math.inf
            tn = min(seg_end, end, ready, fail)
            dt = tn - t
            usd += dt * g * (self.on_demand * r.price_on_demand + live * r.price_spot) / HOUR
            if self.running or self.ready:
                training += dt
                self.started = True
            if phase == "work":
                chunk += dt * rate
            elif phase != "idle":
                left -= dt
            t = tn
            if tn == fail:
                phase, left, chunk = self._loss(True, phase, left, chunk)
                self._place(t, live)
            elif tn == ready:
                self.ready.pop(0)
                self.running += 1
                phase = "work" if phase == "idle" else phase
            elif tn == end:
                if phase == "work":
                    phase, left = "save", r.checkpoint_s
                else:
                    committed += chunk if phase == "save" else 0.0
                    chunk = 0.0 if phase == "save" else chunk
                    phase = "work"
            else:
                k = (k + 1) % ticks
                seg_end = t + ends[k] - times[k]
                before, live, cap_before, cap = live, lives[k], cap, caps[k]
                phase, left, chunk = self._capacity(before, cap_before, cap, phase, left, chunk)
                self._place(t, live)
        wall = t if committed >= self.work else math.inf
        return Run(wall, usd, self.restarts, training)

    def _loss(self, running: bool, phase: str, left: float, chunk: float) -> tuple[str, float, float]:
        """A group lost (`running`: a training one): the others stall for detection and re-quorum and redo the
        step in flight; with no group left, everything since the last save is lost."""
        if not running:
            self._lose(False)
            return phase, left, chunk
        rate_before = self.running / self.n
        self._lose(True)
        if not self.running:
            return "idle", 0.0, 0.0
        if phase == "save":  # the survivors finish the save, then stall
            return phase, left + self.cost.stall_s, chunk
        return "stall", self.cost.stall_s, max(0.0, chunk - self.cost.redo_s * rate_before)

    def _capacity(self, before: int, up: int, cap: int, phase: str, left: float,
                  chunk: float) -> tuple[str, float, float]:  # fmt: skip
        """The trace lost `up - cap` of its `up` nodes: each one of the pool's spot nodes a group holds with
        probability (held)/(trace's up), drawn as `replay._Job._capacity` draws them."""
        for _ in range(max(0, up - cap)):
            held = min(before, max(0, self.per_group * (self.running + len(self.ready)) - self.on_demand))
            if up > 0 and held > 0 and self.rng.random() < held / up:
                running = self.rng.random() * (self.running + len(self.ready)) < self.running
                phase, left, chunk = self._loss(running, phase, left, chunk)
                before -= self.per_group
            up -= 1
        return phase, left, chunk


@dataclass(frozen=True)
class LiveVerdict:
    """Live recovery and checkpoint restart of one pool on one trace, and which is recommended."""

    groups: int
    cost: FaultCost
    live: Replay
    restart: Replay

    @property
    def recommended(self) -> str:
        """'live recovery' where its median dollars (then wall time) are lower, else 'checkpoint restart' (also on a
        tie: the simpler launch where nothing is gained)."""
        if self.live.feasible and (not self.restart.feasible or (self.live.usd_p50, self.live.wall_p50)
                                   < (self.restart.usd_p50, self.restart.wall_p50)):  # fmt: skip
            return "live recovery"
        return "checkpoint restart"

    def line(self) -> str:
        """One line: both replays' medians, the per-loss terms, the verdict."""

        def text(rp: Replay) -> str:
            if not rp.feasible:
                return "cannot finish"
            return f"p50 ${si(rp.usd_p50)}, {duration_text(rp.wall_p50)}, {rp.restarts_p50:,.0f} whole-job restarts"

        c = self.cost
        return (f"live recovery ({self.groups} replica groups; a lost group costs {c.stall_s:.3g} s of detection and "
                f"re-quorum, a redone step ({duration_text(c.redo_s)}), then {duration_text(c.down_s)} of start-up "
                f"and heal at {self.groups - 1}/{self.groups} speed): {text(self.live)}; checkpoint restart: "
                f"{text(self.restart)} → {self.recommended}")  # fmt: skip

    def to_dict(self) -> dict:
        return {"groups": self.groups, "recommended": self.recommended, "live": self.live.to_dict(),
                "restart": self.restart.to_dict(), "detect_s": self.cost.detect_s,
                "requorum_s": self.cost.requorum_s, "redo_s": self.cost.redo_s, "startup_s": self.cost.startup_s,
                "heal_s": self.cost.heal_s}  # fmt: skip


def replay_live(work_s: float, restart: Replay, rates: Rates, trace: Trace, cost: FaultCost, runs: int = RUNS,
                seed: int = 0) -> LiveVerdict:  # fmt: skip
    """Replay `restart`'s pool (its closed form's checkpoint interval) as `cost.groups` replica groups from the
    same seeded start offsets, and set it beside the restart replay."""
    pool = restart.pool
    if pool.nodes % cost.groups:
        raise LiveError(f"--replica-groups {cost.groups}: the pool's {pool.nodes} nodes do not split into "
                        f"{cost.groups} groups of whole nodes; valid: a divisor of {pool.nodes}")  # fmt: skip
    closed: Estimate = restart.closed
    interval = closed.interval_s or work_s
    starts = random.Random(seed)
    played = []
    for i in range(runs):
        offset = starts.uniform(0, trace.duration_s)
        job = _LiveJob(work_s, pool, rates, trace, interval, cost, random.Random(f"live:{seed}:{i}"))
        played.append(job.play(offset, HORIZON * work_s))
    reason = "" if any(math.isfinite(p.wall_s) for p in played) else "no run finished within the horizon"
    return LiveVerdict(cost.groups, cost, _summary(pool, closed, played, runs, reason, None, None), restart)


def group_refusal(s: Candidate, groups: int, global_batch: int, nodes: int, nproc: int) -> str:
    """Why `s` cannot run as `groups` replica groups (one line), or "" when it can: ZeRO 0 (a ZeRO shard
    across the groups has no copy on a live peer), dp and the global batch divisible by the groups, and each
    group whole nodes or a whole share of one node."""
    if s.zero:
        return (f"ZeRO-{s.zero} shards the optimizer state across the replicas: a lost group's shard has no copy on a "
                "live peer, so it falls back to checkpoint restart; valid: ZeRO 0 (--zero 0)")  # fmt: skip
    if s.dp % groups:
        return f"the layout's dp {s.dp} does not split into {groups} groups; valid: a divisor of {s.dp}"
    if global_batch % groups:
        return f"the global batch {global_batch} does not split into {groups} groups; valid: a divisor of it"
    if nodes % groups and (nodes != 1 or nproc % groups):
        return (f"{nodes} nodes of {nproc} ranks do not split into {groups} groups of whole nodes (or of a whole "
                "share of one node)")  # fmt: skip
    return ""


def recommend(plan: Plan, global_batch: int, job: Rates, trace: Trace, restart: Replay, groups: int = 0,
              runs: int = RUNS, seed: int = 0) -> LiveVerdict | str:  # fmt: skip
    """Live recovery against checkpoint restart of `plan` on `restart`'s pool (its replay on `trace`), as
    `groups` replica groups (0: the most groups of whole nodes the plan can run as); one line instead where
    the plan cannot run as groups of whole nodes, which the replay prices."""
    s, pool = plan.strategy, restart.pool
    nproc = round(s.gpus / pool.nodes)
    if not groups:
        fit = [
            n
            for n in range(2, pool.nodes + 1)
            if not pool.nodes % n and not group_refusal(s, n, global_batch, pool.nodes, nproc)
        ]
        if not fit:
            why = group_refusal(s, 2, global_batch, pool.nodes, nproc) or f"{pool.nodes} node(s) cannot form 2 groups"
            return f"live recovery not priced: {why}"
        groups = fit[-1]
    if pool.nodes % groups:
        return (f"live recovery not priced: {groups} groups share {pool.nodes} node(s), so one lost node takes several "
                "groups down (the replay prices groups of whole nodes)")  # fmt: skip
    state = plan.checkpoint_bytes * s.dp / s.gpus  # ZeRO 0: every rank holds its replica's share of the states
    cost = fault_cost(groups, plan.step.total, state, job.restart_s)
    return replay_live(plan.step.train_days * 86400, restart, job, trace, cost, runs, seed)
