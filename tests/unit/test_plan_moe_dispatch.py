"""Expert all-to-all under tensor + sequence parallelism (meshlm.plan.step_time.ep_layer_time), from first
principles: with sequence parallelism a tp rank holds s/tp of the tokens, and Megatron's all-to-all dispatcher
sends those (then all-gathers the received k-fold rows over tp, reduce-scatters them back at the combine),
so its expert-parallel all-to-all carries tokens/tp rows per rank, not every token from every tp rank (the
planner's figure before issue 48: tp× too large). meshlm's own runtime (meshlm.parallel.tp.moe) exchanges
the whole gathered sequence from each tp rank, so it keeps the full figure. Mutation: sending `tokens` on the
megatron runtime too fails the first test by the factor tp; dropping the tp regather fails it too."""

from __future__ import annotations

import pytest

from meshlm.model.config import preset
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import Candidate, hardware
from meshlm.plan.network import group_time
from meshlm.plan.step_time import ep_layer_time


def all_to_all(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """A rank sends (n − 1)/n of its buffer in n − 1 pairwise steps (docs/planner.md, α–β collectives)."""
    return (n - 1) / n * nbytes / beta + (n - 1) * alpha


def test_megatron_dispatcher_sends_a_tp_share_of_the_tokens_under_sequence_parallelism() -> None:
    cfg, hw = preset("mixtral-8x7b"), hardware("H100-SXM")
    tokens, act, tp, ep, k = 4096, 2, 2, 4, 2  # tp·ep = 8: one node
    s = Candidate(Layout(dp=8, ep=ep, tp=tp), ParallelOptions(zero=1, sequence_parallel=True))
    link = hw.intra
    rows = all_to_all(tokens / tp * k * cfg.dim * act, ep, link.alpha, link.beta)
    counts = all_to_all(8 * cfg.n_experts, ep, link.alpha, link.beta)
    extra = (k - 1) * tokens * cfg.dim * act  # the k-fold rows gathered over tp, beyond the dense MLP's tokens
    regather = sum(group_time(hw, "tp", False, op, extra, tp, tp) for op in ("all_gather", "reduce_scatter"))
    megatron = ep_layer_time(cfg, tokens, s, hw, act, "megatron")
    assert megatron == pytest.approx(2 * (2 * rows + regather) + counts, rel=1e-12)
    full_rows = all_to_all(tokens * k * cfg.dim * act, ep, link.alpha, link.beta)
    assert ep_layer_time(cfg, tokens, s, hw, act, "meshlm") == pytest.approx(4 * full_rows + counts, rel=1e-12)
    # without sequence parallelism every Megatron tp rank holds every token: the full rows, no regather
    no_sp = Candidate(Layout(dp=8, ep=ep, tp=tp), ParallelOptions(zero=1, sequence_parallel=False))
    assert ep_layer_time(cfg, tokens, no_sp, hw, act, "megatron") == pytest.approx(4 * full_rows + counts, rel=1e-12)


def test_the_dispatch_all_to_all_shrinks_with_tp() -> None:
    """The bandwidth part of the dispatch all-to-all falls as 1/tp on the megatron runtime (the latency part
    is the same number of steps): at tp 4 a quarter of tp 1's bytes."""
    cfg = preset("mixtral-8x7b")
    free_latency = hardware("H100-SXM", {"device": "H100-SXM", "links": {"intra": {"all_gather": {
        "alpha_s": 0.0, "beta_Bps": 1e30}, "reduce_scatter": {"alpha_s": 0.0, "beta_Bps": 1e30}}}})  # fmt: skip
    hw = free_latency
    times = {}
    for tp in (1, 4):
        s = Candidate(Layout(dp=8 // tp, ep=2, tp=tp), ParallelOptions(zero=1, sequence_parallel=tp > 1))
        times[tp] = ep_layer_time(cfg, 4096, s, hw, 2, "megatron") - ep_layer_time(cfg, 0, s, hw, 2, "megatron")
    assert times[4] == pytest.approx(times[1] / 4, rel=1e-9)
