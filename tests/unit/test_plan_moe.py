"""The planner on mixture-of-experts models (docs/planner.md, "Mixture of experts and expert parallelism"):
dense and expert parameters per rank, an MoE layer's activations against what autograd saves, the all-to-all
time of expert parallelism, the node placement of every mesh group, and a search that proposes ep for
Mixtral on 64 H100s and nothing the runtime refuses. The bytes the runtime holds per rank under ep are
checked in tests/parallel/test_zero_bytes.py, the published Mixtral run in tests/unit/test_plan_published.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_layout_agreement import runtime_accepts

from meshlm.config import load_config, parse_overrides
from meshlm.model import Transformer, cross_entropy_loss, param_counts, preset
from meshlm.model.llama import set_recompute
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel.mesh import DIMS, FLAT_GROUPS, Layout, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import PlannerError, Workload, hardware, search
from meshlm.plan.memory import (
    Candidate,
    layer_activation_bytes,
    moe_layer_activation_bytes,
    moe_stage_params,
    rank_moe_layers,
)
from meshlm.plan.network import collective_time, crosses_nodes
from meshlm.plan.search import Constraints, plan_for_config
from meshlm.plan.step_time import ep_layer_time, step_time

PRESETS = ("tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b")


@pytest.mark.parametrize("name", PRESETS)
def test_dense_and_expert_parameters_are_the_models(name: str) -> None:
    """At tp = pp = ep = 1 a rank's dense and expert Ψ sum to the model's parameter count; ep divides only the
    routed experts; a pipeline split puts every MoE layer on exactly one rank and the ranks' Ψ sum to the
    whole (untied heads: the last rank's head is the model's)."""
    cfg = preset(name)
    counts, n_moe = param_counts(cfg), len(cfg.moe_layers)
    dense, experts = moe_stage_params(cfg, 1, 1, cfg.n_layers, n_moe, True, True)
    assert dense + experts == counts["total"]
    assert experts == n_moe * cfg.n_experts * counts["expert_per_layer"]
    for ep in (2, cfg.n_experts):
        assert moe_stage_params(cfg, 1, ep, cfg.n_layers, n_moe, True, True) == (dense, experts / ep)
    for pp, v in ((2, 1), (4, 1), (2, 2)):
        moe = rank_moe_layers(cfg, pp, v)
        assert sum(moe) == n_moe
        layers = [cfg.n_layers // pp] * pp  # every preset splits evenly at these sizes
        ranks = [moe_stage_params(cfg, 1, 1, layers[i], moe[i], i == 0, i == pp - 1) for i in range(pp)]
        if not cfg.tie_embeddings:
            assert sum(d + e for d, e in ranks) == counts["total"], (pp, v)


def test_a_dense_first_layer_lands_on_the_first_stage() -> None:
    """tiny-moe's first layer is dense (first_k_dense = 1): of its 4 layers split over 2 stages, the first
    holds one MoE layer and the second two, so the second stage holds more experts."""
    cfg = preset("tiny-moe")
    assert rank_moe_layers(cfg, 2) == (1, 2)
    first, second = (moe_stage_params(cfg, 1, 1, 2, n, i == 0, i == 1)[1] for i, n in enumerate((1, 2)))
    assert second == 2 * first > 0


# An MoE block of the "test" shape with every layer MoE: 4 experts of the dense SwiGLU's width, top-2, and a
# gated shared expert (Qwen2-MoE), or 8 experts without one (Mixtral).
MOE_MODELS = {
    "qwen2_moe": preset("test").replace(
        hf_model_type="qwen2_moe", qkv_bias=True, n_experts=4, top_k=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=64, shared_expert_gate=True,
    ),
    "mixtral": preset("test").replace(hf_model_type="mixtral", n_experts=8, top_k=2, moe_intermediate_size=128),
}  # fmt: skip
BATCH, SEQ_LEN = 2, 32
TOLERANCE = 0.10  # the planner's standard for measured memory (tests/parallel/test_recompute.py, test_plan_measured.py)


def saved_bytes(cfg: object, n_layers: int, policy: str) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg.replace(n_layers=n_layers))
    set_recompute(model, policy)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN))
    with ActivationMeter(model) as meter:
        loss = cross_entropy_loss(model(x), x)
    loss.backward()
    return meter.peak


@pytest.mark.parametrize("family", MOE_MODELS)
@pytest.mark.parametrize("policy", ["none", "full"])
def test_moe_layer_activations_match_autograd(family: str, policy: str) -> None:
    """What autograd saves for one MoE layer (two layers less one: the logits cancel) is within 10 % of
    moe_layer_activation_bytes (measured 0.96 and 0.99 without recompute, exact with full recompute). The
    formula is sharp: an MoE layer counted as a dense layer of the expert's width (one row per token, no
    dispatch, no router) is ≥ 30 % under."""
    cfg = MOE_MODELS[family]
    measured = saved_bytes(cfg, 2, policy) - saved_bytes(cfg, 1, policy)
    planned = moe_layer_activation_bytes(cfg, SEQ_LEN, BATCH, 1, False, policy, "fp32")
    assert abs(planned / measured - 1) <= TOLERANCE, (measured, planned)
    if policy == "none":
        as_dense = layer_activation_bytes(cfg.replace(intermediate_size=cfg.moe_intermediate_size), SEQ_LEN, BATCH, 1,
                                          False, policy, "fp32")  # fmt: skip
        assert as_dense / measured < 0.7


def test_all_to_all_time_per_moe_layer() -> None:
    """Dispatch and combine forward, both again in backward (6 with full recompute), each an all-to-all of
    the k·tokens rows of h elements over ep, plus one exchange of the E row counts (int64) per forward; on
    NVLink within a node, on the network when the ep group spans nodes; nothing without ep."""
    cfg, hw = preset("mixtral-8x7b"), hardware("H100-SXM")
    tokens, act = 4096, 2
    rows, counts = tokens * cfg.top_k * cfg.dim * act, 8 * cfg.n_experts

    def expected(ep: int, link: object, exchanges: int, forwards: int) -> float:
        one = (ep - 1) / ep * rows / link.beta + (ep - 1) * link.alpha
        return exchanges * one + forwards * ((ep - 1) / ep * counts / link.beta + (ep - 1) * link.alpha)

    within = Candidate(Layout(dp=8, ep=8), ParallelOptions(zero=1))
    assert ep_layer_time(cfg, tokens, within, hw, act) == pytest.approx(expected(8, hw.intra, 4, 1), rel=1e-12)
    full = Candidate(Layout(dp=8, ep=8), ParallelOptions(zero=1), recompute="full")
    assert ep_layer_time(cfg, tokens, full, hw, act) == pytest.approx(expected(8, hw.intra, 6, 2), rel=1e-12)
    assert collective_time("all_to_all", rows, 8, hw.intra) == pytest.approx(expected(8, hw.intra, 1, 0))
    assert ep_layer_time(cfg, tokens, Candidate(Layout(dp=64), ParallelOptions(zero=1)), hw, act) == 0.0
    across = Candidate(
        Layout(dp=4, ep=8, tp=2), ParallelOptions(zero=1)
    )  # ep stride 2 × 8 ranks: spans two 8-GPU nodes
    assert crosses_nodes(across.mesh, "ep", 8)
    assert ep_layer_time(cfg, tokens, across, hw, act) == pytest.approx(expected(8, hw.inter, 4, 1), rel=1e-12)

    # in a step: every MoE layer of a micro-batch, m micro-batches (pp = 1: one stage holds all 32 layers)
    w = Workload(cfg, 4096, 256, 1e12)
    s = Candidate(Layout(dp=8, ep=8), ParallelOptions(zero=3), micro_batch=1, recompute="full")
    step = step_time(w, s, hw)
    assert step.ep_comm == pytest.approx(s.micro_batches(256) * 32 * ep_layer_time(cfg, tokens, s, hw, act))
    parts = step.parts()
    assert parts.pop("total") == pytest.approx(sum(parts.values())) and parts["ep_comm"] == step.ep_comm


def meshes(world: int) -> list[Layout]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [
        Layout(pp, world // (pp * ep * cp * tp), tp, cp, ep)
        for pp, ep, cp, tp in itertools.product(divisors, repeat=4)
        if world % (pp * ep * cp * tp) == 0
    ]


def crosses_by_enumeration(mesh: Layout, dim: str, gpus_per_node: int) -> bool:
    """Every rank's coordinates (pp, dp, ep, cp, tp; tp fastest), its group the ranks that share its
    coordinates outside the group's dims: does any group hold ranks of two nodes?"""
    dims = FLAT_GROUPS.get(dim, (dim,))
    groups: dict[tuple, set[int]] = {}
    for rank, coords in enumerate(itertools.product(*(range(getattr(mesh, d)) for d in DIMS))):
        key = tuple(c for c, d in zip(coords, DIMS, strict=True) if d not in dims)
        groups.setdefault(key, set()).add(rank // gpus_per_node)
    return any(len(nodes) > 1 for nodes in groups.values())


def test_crosses_nodes_agrees_with_every_group() -> None:
    """For every mesh of 8, 12, 16 and 24 ranks over nodes of 2, 4 and 8, every dim and flattened group:
    crosses_nodes says what enumerating the groups' ranks says, and both verdicts occur."""
    verdicts = []
    for g, mesh_ in ((g, m) for w in (8, 12, 16, 24) for g in (2, 4, 8) for m in meshes(w)):
        for dim in (*DIMS, *FLAT_GROUPS):
            verdict = crosses_nodes(mesh_, dim, g)
            assert verdict == crosses_by_enumeration(mesh_, dim, g), (mesh_, dim, g)
            verdicts.append(verdict)
    assert any(verdicts) and not all(verdicts)


# One 64-GPU Mixtral search serves the ranking and the runtime checks (a search through the CLI cost another ~45 s; the
# CLI runs a 64-GPU Mixtral search for real in tests/integration/test_docs_commands.py: docs/planner.md's MoE line).
@pytest.mark.slow  # a 64-GPU search and its 89,671 plans through the runtime's checks: ~100 s; tiny-moe below is fast
def test_every_mixtral_plan_on_64_h100s_is_one_the_runtime_runs() -> None:
    """All the layouts that fit Mixtral 8x7B on 64 H100s pass the trainer's checks, ep composed with pp and tp
    among them; at 4,096 tokens a sequence none has cp (below CP_MIN_SEQ_LEN the search leaves it out), and with
    cp asked for, ep composes with it too.

    The search ranks expert-parallel layouts among its five best (what `meshlm plan --json --top 5` prints:
    ep within a node, the all-to-alls of 32 MoE layers per micro-batch on NVLink), each plan's memory counting
    expert shards of E/ep experts and its step time their all-to-alls."""
    w = Workload(preset("mixtral-8x7b"), 4096, 256, 1e12)
    plans = search(w, 64, hardware("H100-SXM"), priced=0).plans
    with_ep = [p.to_dict() for p in plans[:5] if p.strategy.ep > 1]
    assert with_ep and all(f"ep={p['ep']}" in p["layout"] and p["ep"] <= 8 for p in with_ep)
    assert all(p["step_parts_s"]["ep_comm"] > 0 for p in with_ep)
    strategies = [p.strategy for p in plans]
    assert {s.ep for s in strategies} == {1, 2, 4, 8}
    assert all(runtime_accepts(s, w.model, w.seq_len, w.global_batch) for s in strategies)
    for dim in ("pp", "tp"):
        assert any(s.ep > 1 and getattr(s, dim) > 1 for s in strategies), dim
    assert all(s.cp == 1 for s in strategies)
    with_cp = [p.strategy for p in search(w, 64, hardware("H100-SXM"), constraints=Constraints(cp=2), priced=0).plans]
    assert with_cp and all(s.cp == 2 and runtime_accepts(s, w.model, w.seq_len, w.global_batch) for s in with_cp)
    assert any(s.ep > 1 for s in with_cp)


def test_the_search_offers_only_what_the_runtime_runs() -> None:
    """Every plan of a tiny-moe search on 8 ranks (ep, dp, pp, tp, cp and ZeRO free) is a layout the trainer
    accepts (its layout checks and ParallelModel's plan checks), ep among them, alone and composed."""
    w = Workload(preset("tiny-moe"), 128, 16, 1e7, "fp32")
    result = search(w, 8, hardware("cpu"), memory_only=True)
    strategies = [p.strategy for p in result.plans]
    assert any(s.ep > 1 for s in strategies) and any(s.ep == 1 and s.pp > 1 for s in strategies)
    assert all(runtime_accepts(s, w.model, w.seq_len, w.global_batch) for s in strategies)
    assert any(s.ep > 1 and s.pp * s.tp * s.cp > 1 for s in strategies)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_layout_of_tiny_moe_is_one_the_trainer_runs(world: int) -> None:
    """`--parallel.layout auto` on tiny-moe picks a layout (ep among the choices) that the trainer's checks
    accept as its config overrides say it."""
    overrides = ["--model.preset", "tiny-moe", "--train.global_batch", "8", "--data.seq_len", "64"]
    cfg = load_config(None, parse_overrides(overrides))
    strategy = plan_for_config(cfg, world)
    assert strategy.gpus == world
    assert runtime_accepts(strategy, cfg.model.build(), 64, 8)
    picked = load_config(None, parse_overrides([*overrides, *(f"--{k}={v}" for k, v in strategy.overrides().items())]))
    assert parse_layout(picked.parallel.layout, world) == strategy.mesh


def test_lora_on_an_moe_model_is_refused_in_one_line() -> None:
    """LoRA's formulas count a dense layer's projections: planning it on MoE layers would be silently wrong."""
    w = Workload(preset("mixtral-8x7b"), 4096, 256, 1e12, lora_rank=16)
    with pytest.raises(PlannerError, match=r"^the planner does not model LoRA on mixture-of-experts layers"):
        search(w, 64, hardware("H100-SXM"))
