"""Prices, failure and preemption rates, and checkpoint timing: what turns a step time into the wall time and
dollars of a whole run (on demand, spot or mixed, `meshlm.plan.spot`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshlm.plan.hardware import Hardware
from meshlm.plan.spot import ALL_SHAPES, Offerings, Rates, Shapes, compare


@dataclass(frozen=True)
class CostModel:
    """Prices and failure rates; None prices come from the hardware table."""

    price_on_demand: float | None = None  # $ per GPU-hour
    price_spot: float | None = None
    # Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
    failure_rate: float = 419 / (54 * 24 * 16384)  # per GPU-hour, both offerings
    preemption_rate: float = 1e-3  # spot preemptions, per `preemption_per`; illustrative
    preemption_per: Literal["gpu-hour", "node-hour", "job-hour"] = "gpu-hour"
    replace_s: float = 3600.0  # mean time until a preempted spot node is back; illustrative
    restart_s: float = 600.0  # reschedule (Slurm 22.05's requeue alone waits ~121 s), re-initialise, warm up
    storage_gbps: float = 20.0  # aggregate checkpoint write/read bandwidth, GB/s
    deadline_s: float | None = None  # wall-time limit: pools that miss it are not recommended
    shapes: Shapes = ALL_SHAPES  # the pools priced: those the launcher (`meshlm plan --emit`) can run


DEFAULT_COSTS = CostModel()


def nodes_of(gpus: int, gpus_per_node: int) -> int:
    """Nodes a job of `gpus` devices occupies (a partial node is a whole one)."""
    return math.ceil(gpus / gpus_per_node)


def rates(gpus: int, checkpoint_bytes: float, hw: Hardware, c: CostModel = DEFAULT_COSTS) -> Rates:
    """The interruption rates, times and prices of a job of `gpus` devices. A per-GPU preemption rate makes a
    node's g times that; a per-job rate is spread over the job's nodes."""
    delta = checkpoint_bytes / (c.storage_gbps * 1e9)
    per_node = {"gpu-hour": hw.gpus_per_node, "node-hour": 1, "job-hour": 1 / nodes_of(gpus, hw.gpus_per_node)}
    return Rates(
        failure_per_gpu_hour=c.failure_rate,
        preemption_per_node_hour=c.preemption_rate * per_node[c.preemption_per],
        replace_s=c.replace_s,
        restart_s=c.restart_s,
        checkpoint_s=delta,
        load_s=delta,
        price_on_demand=hw.price_on_demand if c.price_on_demand is None else c.price_on_demand,
        price_spot=hw.price_spot if c.price_spot is None else c.price_spot,
    )


def run_cost(
    solve_s: float,
    gpus: int,
    checkpoint_bytes: float,
    hw: Hardware,
    c: CostModel = DEFAULT_COSTS,
    speed: Callable[[int], float] | None = None,
    min_nodes: int | None = None,
) -> Offerings:
    """Price a run of `solve_s` failure-free seconds on `gpus` devices on demand, on spot and mixed; elastic
    pools shrink to `min_nodes` at `speed(nodes)` of the full layout's throughput."""
    if solve_s <= 0:
        raise ValueError(f"run length must be > 0 s, got {solve_s}")
    nodes = nodes_of(gpus, hw.gpus_per_node)
    r = rates(gpus, checkpoint_bytes, hw, c)
    return compare(solve_s, nodes, gpus / nodes, r, speed, min_nodes, c.deadline_s, c.shapes)
