"""Every rank's step metrics side by side: min / median / max per metric and the straggler, if any.

In synchronous training every rank's step *time* is about the same (collectives make the fast ranks wait for
the slow one), so the slow rank shows in its *compute* time, and the others show the wait as exposed
communication. That is why stragglers are judged on compute_s when it is there, else on step_time_s.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

STRAGGLER_METRICS = ("compute_s", "step_time_s")


def summarize(per_rank: list[dict[str, float]], straggler_threshold: float = 1.2) -> dict[str, float]:
    """min / median / max of each numeric metric over ranks (absent = 0: a timer that never ran), the slowest
    rank and its ratio to the median; `straggler_rank` is that rank when the ratio exceeds the threshold, else -1."""
    names = sorted({k for m in per_rank for k, v in m.items() if isinstance(v, int | float)})
    out: dict[str, float] = {"n_ranks": len(per_rank)}
    for name in names:
        values = [float(m.get(name, 0.0)) for m in per_rank]
        out[f"{name}_min"] = min(values)
        out[f"{name}_median"] = statistics.median(values)
        out[f"{name}_max"] = max(values)
    judged = next((n for n in STRAGGLER_METRICS if n in names), None)
    if judged is not None:
        values = [float(m.get(judged, 0.0)) for m in per_rank]
        slowest = max(range(len(values)), key=values.__getitem__)
        median = statistics.median(values)
        ratio = values[slowest] / median if median > 0 else 1.0
        out["slowest_rank"] = slowest
        out["straggler_ratio"] = ratio
        out["straggler_rank"] = slowest if ratio > straggler_threshold else -1
    return out


def aggregate(
    metrics: dict[str, float], straggler_threshold: float = 1.2, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Gather every rank's metrics (a collective: call it on all ranks at the same step) and summarize.

    Ranks in the summary are positions in `group` (global ranks for the default group)."""
    import torch.distributed as dist

    per_rank: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(per_rank, metrics, group=group)
    return summarize(per_rank, straggler_threshold)
