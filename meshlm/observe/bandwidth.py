"""Bus bandwidth (the nccl-tests definitions) and the α–β fit the planner prices collectives with.

For a collective on n ranks over a message of `nbytes` (the whole buffer: all-reduce's buffer, all-gather's
output, reduce-scatter's input, the bytes one rank sends for send/recv) taking t seconds:
    algbw = nbytes / t
    busbw = algbw · factor,  factor = 2(n−1)/n all-reduce, (n−1)/n all-gather and reduce-scatter, 1 send/recv
busbw is what each link carried per second in a ring algorithm, so it is comparable across n and ops.
The planner's model is t = steps·α + factor·nbytes/β with steps = 2(n−1), n−1, n−1 and 1: α is the latency
of one ring step and β the bus bandwidth. A least-squares line t = a + b·nbytes gives α = a/steps, β = factor/b.
"""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests, doc/PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")


def ring_steps(op: str, n: int) -> int:
    """Latency-bound steps of the ring algorithm (α is paid once per step)."""
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "send_recv": 1}[op]


def busbw(op: str, n: int, nbytes: float, seconds: float) -> float:
    return nbytes / seconds * bus_factor(op, n)


def fit_link(op: str, n: int, sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(α seconds per ring step, β bus bytes/s) by least squares over a size sweep.

    Noise can make the intercept negative (then the line is refitted through the origin, α = 0) or the slope
    non-positive (latency-bound sweep: β falls back to the best busbw measured)."""
    m = len(sizes)
    mean_x, mean_t = sum(sizes) / m, sum(seconds) / m
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(sizes, seconds, strict=True)) / sxx if sxx else 0.0
    intercept = mean_t - slope * mean_x
    if intercept < 0:
        intercept, slope = 0.0, sum(x * t for x, t in zip(sizes, seconds, strict=True)) / sum(x * x for x in sizes)
    factor = bus_factor(op, n)
    beta = factor / slope if slope > 0 else max(busbw(op, n, x, t) for x, t in zip(sizes, seconds, strict=True))
    return intercept / ring_steps(op, n), beta
