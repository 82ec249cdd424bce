"""Which layers each pipeline stage holds: contiguous, at least one each, balanced by cost.

No torch here: the runtime (`pipeline.split_model`) and the planner (`meshlm.plan.memory`) call the same
split, so the planner predicts memory for the stages that will run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from meshlm.model.config import ModelConfig
from meshlm.model.flops import part_costs


def stage_layers(
    cfg: ModelConfig,
    n_stages: int,
    boundaries: Sequence[int] | None = None,
    cost: str = "flops",
) -> list[range]:
    """Layer indices of each stage of meshlm's Llama (the planner predicts memory for this same split)."""
    return split_layers(cfg.n_layers, n_stages, part_costs(cfg, cost), boundaries)


def split_layers(
    n: int, n_stages: int, costs: tuple[float, float, float], boundaries: Sequence[int] | None = None
) -> list[range]:
    """Layer indices of each of `n_stages` stages of `n` layers: contiguous, non-empty, in order.

    `boundaries` lists the first layer of stages 1..n_stages-1 explicitly; otherwise the split minimises
    the most expensive stage (then the spread), with `costs` = (first-stage modules, one layer, last-stage
    modules), so the embedding counts on stage 0 and the head on the last.
    """
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} pipeline stages (each stage needs a layer)")
    if boundaries is not None:
        cuts = [0, *boundaries, n]
        if len(cuts) != n_stages + 1 or any(a >= b for a, b in itertools.pairwise(cuts)):
            raise ValueError(
                f"pipeline boundaries {list(boundaries)} must be {n_stages - 1} increasing layer indices in 1..{n - 1}"
            )
        return [range(a, b) for a, b in itertools.pairwise(cuts)]

    embed, layer, head = costs
    # best[k][j] = (cost of the worst stage, Σ stage cost², first layer of stage k) for layers [0, j) in k+1
    # stages; only the j that leave a layer for each later stage. Ties go to the earliest first layer.
    # (The loops are spelled out: the planner runs this for up to 126 layers in as many chunks.)
    last = n_stages - 1
    first = {}
    for j in range(1, n - last + 1):
        c = j * layer + embed + (head if last == 0 else 0.0)
        first[j] = (c, c**2, 0)
    best = [first]
    for k in range(1, n_stages):
        prev, extra, row = best[k - 1], head if k == last else 0.0, {}
        for j in range(k + 1, n - last + k + 1):
            choice = None
            for i in range(k, j):
                worst, squares, _ = prev[i]
                c = (j - i) * layer + extra
                candidate = (worst if worst >= c else c, squares + c * c, i)
                if choice is None or candidate < choice:
                    choice = candidate
            row[j] = choice
        best.append(row)
    cuts, j = [n], n
    for k in range(n_stages - 1, 0, -1):
        j = best[k][j][2]
        cuts.append(j)
    cuts.append(0)
    cuts.reverse()
    return [range(a, b) for a, b in itertools.pairwise(cuts)]
