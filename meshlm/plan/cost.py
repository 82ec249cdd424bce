"""Wall time and dollars for a whole run, on demand and on spot, once failures, preemptions and
checkpoints are priced in. Checkpoint interval: Young (1974); expected wall time: Daly (2006)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from meshlm.plan.hardware import Hardware

HOUR = 3600.0


@dataclass(frozen=True)
class CostModel:
    """Prices and failure rates; None prices come from the hardware table."""

    price_on_demand: float | None = None  # $ per GPU-hour
    price_spot: float | None = None
    # Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
    failure_rate: float = 419 / (54 * 24 * 16384)  # per GPU-hour, both offerings
    preemption_rate: float = 1e-3  # spot preemptions, per `preemption_per`; illustrative
    preemption_per: Literal["gpu-hour", "job-hour"] = "gpu-hour"
    restart_s: float = 600.0  # reschedule, re-initialise, warm up (plus reading the checkpoint back)
    storage_gbps: float = 20.0  # aggregate checkpoint write/read bandwidth, GB/s


DEFAULT_COSTS = CostModel()


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


@dataclass(frozen=True)
class RunCost:
    checkpoint_s: float  # δ, time to write one checkpoint
    mtbf_on_demand_s: float
    mtbf_spot_s: float
    interval_on_demand_s: float
    interval_spot_s: float
    wall_on_demand_s: float
    wall_spot_s: float
    usd_on_demand: float
    usd_spot: float


def run_cost(solve_s: float, gpus: int, checkpoint_bytes: float, hw: Hardware, c: CostModel = DEFAULT_COSTS) -> RunCost:
    """Price a run of `solve_s` failure-free seconds on `gpus` devices. Restart cost R adds reading the
    checkpoint back; the interval is capped at the run itself (then one checkpoint, at the end)."""
    if solve_s <= 0:
        raise ValueError(f"run length must be > 0 s, got {solve_s}")
    delta = checkpoint_bytes / (c.storage_gbps * 1e9)
    restart = c.restart_s + delta
    failures = c.failure_rate * gpus / HOUR  # per second
    preemptions = c.preemption_rate * (gpus if c.preemption_per == "gpu-hour" else 1) / HOUR
    mtbf = 1 / failures if failures > 0 else math.inf
    mtbf_spot = 1 / (failures + preemptions) if failures + preemptions > 0 else math.inf
    out = {}
    for name, m in (("on_demand", mtbf), ("spot", mtbf_spot)):
        tau = min(young_interval(delta, m), solve_s)
        out[name] = (tau, expected_wall_time(solve_s, tau, delta, restart, m))
    price_od = hw.price_on_demand if c.price_on_demand is None else c.price_on_demand
    price_spot = hw.price_spot if c.price_spot is None else c.price_spot

    def usd(wall: float, price: float) -> float:
        return wall / HOUR * gpus * price if price else 0.0  # a free device costs $0 even if it never ends

    return RunCost(
        checkpoint_s=delta,
        mtbf_on_demand_s=mtbf,
        mtbf_spot_s=mtbf_spot,
        interval_on_demand_s=out["on_demand"][0],
        interval_spot_s=out["spot"][0],
        wall_on_demand_s=out["on_demand"][1],
        wall_spot_s=out["spot"][1],
        usd_on_demand=usd(out["on_demand"][1], price_od),
        usd_spot=usd(out["spot"][1], price_spot),
    )
