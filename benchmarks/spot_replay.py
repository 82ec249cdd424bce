"""The planner's closed-form spot estimate (meshlm.plan.spot.estimate) beside a Monte-Carlo replay of a
preemption trace (meshlm.plan.replay) for 4- and 16-node pools at 0.05-0.7 preemptions per node-hour.

Each row draws a one-year trace of its spot slots from the closed form's own model (Poisson preemptions,
exponential returns; `poisson_trace(slots, rate, 3600, 365 d, seed=1)`), replays 100 runs from seeded
random start offsets, and prints the closed form's expected wall time and dollars against the replay's p50
and p90, with their ratio. docs/planner.md, "Closed form against trace replay", holds the table this prints;
tests/unit/test_plan_replay.py checks every row (p50 within ±10 %) and that the doc shows these numbers.

    .venv/bin/python benchmarks/spot_replay.py        # ~20 s on one core
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlm.plan.replay import Replay, replay
from meshlm.plan.spot import Pool, Rates, duration_text
from meshlm.plan.traces import poisson_trace

HOUR, DAY = 3600.0, 86400.0
WORK_S = 300 * HOUR  # failure-free hours on the full pool
GPUS_PER_NODE = 8
REPLACE_S = 3600.0
TRACE_S = 365 * DAY
RUNS = 100


@dataclass(frozen=True)
class Row:
    nodes: int
    rate: float  # preemptions per node-hour
    spot: int
    spares: int = 0
    min_nodes: int | None = None

    def pool(self) -> Pool:
        return Pool(self.nodes, GPUS_PER_NODE, self.spot, self.spares, self.min_nodes)

    def rates(self) -> Rates:
        return Rates(2e-5, self.rate, REPLACE_S, 600.0, 60.0, 60.0, 6.0, 2.0)

    def speed(self, n: int) -> float:
        return n / self.nodes


ROWS = (
    Row(4, 0.05, 4),
    Row(4, 0.2, 4, spares=1),
    Row(4, 0.7, 2),
    Row(4, 0.7, 4, min_nodes=2),
    Row(16, 0.05, 16, spares=2),
    Row(16, 0.2, 8, spares=2),
    Row(16, 0.7, 4, spares=1),
    Row(16, 0.2, 16, min_nodes=8),  # both say it cannot finish: interruptions outpace restarts
)


def replay_row(row: Row) -> Replay:
    pool = row.pool()
    trace = poisson_trace(pool.spot + pool.spares, row.rate, REPLACE_S, TRACE_S, seed=1)
    return replay(WORK_S, pool, row.rates(), trace, row.speed, runs=RUNS, seed=0)


def cells(row: Row, r: Replay) -> list[str]:
    """The table row: pool, rate, closed-form and replayed wall time and dollars, the p50 ratio."""

    def hours(s: float) -> str:
        return f"{s / HOUR:,.0f} h" if math.isfinite(s) else "cannot finish"

    def usd(x: float) -> str:
        return f"${x:,.0f}" if math.isfinite(x) else "—"

    ratio = f"{r.closed.wall_s / r.wall_p50:.3f}" if r.feasible and r.closed.feasible else "—"
    return [f"{row.nodes}: {r.pool.describe()}", f"{row.rate}", hours(r.closed.wall_s), hours(r.wall_p50),
            hours(r.wall_p90), ratio, usd(r.closed.usd), usd(r.usd_p50), f"{r.closed.restarts:,.0f}"
            if r.closed.feasible else "—", f"{r.restarts_p50:,.0f}" if r.feasible else "—"]  # fmt: skip


HEADER = ["nodes: pool", "λ /node-h", "closed form", "replay p50", "replay p90", "closed / p50", "closed $",
          "replay $ p50", "closed restarts", "replay restarts p50"]  # fmt: skip


def main() -> None:
    print(
        f"work {duration_text(WORK_S)}, {GPUS_PER_NODE} GPUs/node, replace 1 h, restart 10 min + 1 min load, "
        f"checkpoint 1 min, failures 2e-5/GPU-h, $6 / $2 per GPU-h, {RUNS} runs on a 365-day trace\n"
    )
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for row in ROWS:
        r = replay_row(row)
        print("| " + " | ".join(cells(row, r)) + " |")
        if r.reason:
            print(f"<!-- {r.reason} -->")


if __name__ == "__main__":
    main()
