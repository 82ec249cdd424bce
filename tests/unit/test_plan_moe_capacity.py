"""MoE dispatch as it travels (issue 48, item 3), from first principles: Megatron's all-gather dispatcher and
its capacity factor (`--moe-dispatcher`, `--moe-capacity-factor`, `--moe-pad-to-capacity`), priced in
meshlm.plan.exchanges.ep_layer_time and step_time's routed-expert FLOPs.

Mutations, each made and seen failing: pricing the all-gather dispatcher as the all-to-all fails the ep/k
ratio; gathering k rows a token instead of one fails it by k; leaving `rows` out of the all-to-all bytes fails
the capacity test; not scaling the expert FLOPs fails the compute test; letting --runtime meshlm take the
flags fails the CLI test."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from meshlm.model.config import preset
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import Candidate, Workload, hardware, step_time
from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.hardware import Hardware, Link
from meshlm.plan.memory import Assumptions
from meshlm.plan.step_time import ep_layer_time

# A link with no latency and one byte a second: the exchanges' times are their bytes on the wire (the
# α–β model: a ring all-gather or reduce-scatter and an all-to-all each move (n − 1)/n of their buffer).
BYTES_ONLY = {"device": "H100-SXM", "links": {"intra": {
    op: {"alpha_s": 0.0, "beta_Bps": 1.0} for op in ("all_gather", "reduce_scatter")}}}  # fmt: skip


def bytes_only() -> Hardware:
    """An H100 node whose every exchange (ring collectives as calibrated α–β, the all-to-all too) costs its
    bytes on the wire, in seconds."""
    hw = hardware("H100-SXM", BYTES_ONLY)
    return dataclasses.replace(hw, links={("intra", "all_to_all"): Link(0.0, 1.0)} | hw.links)


def test_allgather_moves_ep_over_k_times_the_all_to_all() -> None:
    """The all-to-all sends (ep − 1)/ep of the k rows of each of T tokens; the all-gather dispatcher receives
    the T rows of each other ep rank, (ep − 1)·T, and reduce-scatters as many back: ep/k times the bytes
    (Mixtral, k = 2, ep = 8: 4×), plus the routing probabilities and map (5·E bytes a token, once per
    forward). Four exchanges each (dispatch, combine, both reversed in backward)."""
    hw = bytes_only()
    cfg, tokens, act, ep = preset("mixtral-8x7b"), 4096, 2, 8
    s = Candidate(Layout(dp=1, ep=ep), ParallelOptions(zero=1))
    a2a = ep_layer_time(cfg, tokens, s, hw, act, "megatron")
    ag = ep_layer_time(cfg, tokens, s, hw, act, "megatron", "allgather")
    counts = (ep - 1) / ep * 8 * cfg.n_experts
    assert a2a == pytest.approx(4 * (ep - 1) / ep * tokens * cfg.top_k * cfg.dim * act + counts)
    routing = (ep - 1) / ep * ep * tokens * cfg.n_experts * 5
    hidden = (ep - 1) / ep * ep * tokens * cfg.dim * act
    assert ag == pytest.approx(2 * 2 * hidden + routing)
    assert (ag - routing) / (a2a - counts) == pytest.approx(ep / cfg.top_k)


def test_capacity_factor_scales_the_rows_sent() -> None:
    """Megatron's capacity is ceil(k·T/E · factor) rows an expert: padded to it a rank sends factor × the k·T
    rows of balanced routing, dropped to it (no padding) min(1, factor) of them; dropless is factor 1."""
    assert Assumptions().moe_rows == 1.0
    assert Assumptions(moe_capacity_factor=1.5).moe_rows == 1.0  # balanced routing drops nothing at 1.5
    assert Assumptions(moe_capacity_factor=1.5, moe_pad_to_capacity=True).moe_rows == 1.5
    assert Assumptions(moe_capacity_factor=0.5).moe_rows == 0.5
    hw = bytes_only()
    cfg, s = preset("mixtral-8x7b"), Candidate(Layout(dp=1, ep=8), ParallelOptions(zero=1))
    counts = ep_layer_time(cfg, 0, s, hw, 2, "megatron")
    rows = {r: ep_layer_time(cfg, 4096, s, hw, 2, "megatron", "alltoall", r) - counts for r in (1.0, 1.5)}
    assert rows[1.5] == pytest.approx(1.5 * rows[1.0])


def test_capacity_factor_scales_the_expert_flops_only() -> None:
    """Padded to 1.5× capacity the routed experts compute 1.5× their rows: the step's extra GEMM FLOPs are
    half the routed experts' 6·k·3·h·I_moe per token and MoE layer, priced at the GEMM rate; the attention
    and the all-to-all counts do not change. Model FLOPs (MFU) stay by the k active experts."""
    cfg, hw = preset("mixtral-8x7b"), hardware("H100-SXM")
    w = Workload(cfg, 4096, 64, 1e9, "bf16")
    s = Candidate(Layout(dp=8, ep=8), ParallelOptions(zero=1), micro_batch=1, recompute="none")
    base = step_time(w, s, hw, Assumptions(runtime="megatron"))
    padded = step_time(w, s, hw, Assumptions(runtime="megatron", moe_capacity_factor=1.5, moe_pad_to_capacity=True))
    per_rank = 4096  # 64 sequences over dp·ep = 64 replicas: one micro-batch of 4,096 tokens a rank
    routed = 6 * cfg.top_k * 3 * cfg.dim * cfg.moe_intermediate_size * len(cfg.moe_layers) * per_rank
    expected = 0.5 * routed / (hw.peak_flops * hw.gemm_efficiency)
    # the layer's GEMMs run at their shapes' rate (the grouped experts' rises a little with 1.5× the rows,
    # 0.99 of a large GEMM's here): within 5 % either way
    assert padded.compute - base.compute == pytest.approx(expected, rel=0.05)
    assert padded.tflops_per_gpu * padded.total == pytest.approx(base.tflops_per_gpu * base.total)


def _plan(*extra: str) -> int:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    common = ["--model", "mixtral-8x7b", "--gpus", "64", "--seq-len", "4096", "--global-batch", "256"]
    return run_plan(parser.parse_args(["plan", *common, "--layout", "tp=1,pp=4,ep=8", "--top", "1", *extra]))


@pytest.mark.parametrize(
    "flags",
    [
        ("--moe-dispatcher", "allgather"),  # meshlm's runtime: all-to-all only
        ("--moe-capacity-factor", "1.0"),  # meshlm's runtime: dropless only
        ("--runtime", "megatron", "--moe-capacity-factor", "0"),
        ("--runtime", "megatron", "--moe-pad-to-capacity"),
    ],
)
def test_cli_refuses_what_it_cannot_price(flags: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    """One line naming the flag and what would be valid, exit 2, before any search."""
    assert _plan(*flags) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--moe-" in err and "Traceback" not in err


def test_cli_prices_megatron_allgather(capsys: pytest.CaptureFixture) -> None:
    """On Megatron's runtime the flags are taken and the all-gather dispatcher costs more ep time at ep 8,
    k 2 than the all-to-all (4× its bytes)."""
    times = {}
    for dispatcher in ("alltoall", "allgather"):
        assert _plan("--runtime", "megatron", "--moe-dispatcher", dispatcher, "--json") == 0
        times[dispatcher] = json.loads(capsys.readouterr().out)["plans"][0]["step_parts_s"]["ep_comm"]
    assert times["allgather"] > 2 * times["alltoall"]
