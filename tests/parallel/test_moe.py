"""Mixture of experts in meshlm's model (meshlm.model.moe): routing, dropless dispatch, the auxiliary losses
and their gradient, counts, bad input, and training under dp / ZeRO / pp / cp like one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from distributed import run_shared
from equivalence import (
    assert_close_runs,
    assert_identical_weights,
    criterion_failures,
    reference,
    tail,
    train_layout,
)

from meshlm.config import ConfigError, load_config, parse_overrides
from meshlm.model import ModelConfig, Transformer, cross_entropy_loss, flops_per_token, param_counts, preset
from meshlm.model.llama import MLP
from meshlm.model.moe import (
    MoE,
    MoEAuxLossAutoScaler,
    combine,
    dispatch,
    grouped_mm_available,
    load_balancing_loss,
    moe_losses,
    router_z_loss,
    set_aux_loss_scale,
)
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.strategies import check_layout

# The `test` preset's shape with a Qwen2-MoE-style feed-forward in layers 1-3: every option on (shared expert
# and its gate, a dense first layer) and aux coefficients large enough that a missing aux gradient shows.
MOE_MODEL = preset("test").replace(
    qkv_bias=True,
    hf_model_type="qwen2_moe",
    n_experts=4,
    top_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    shared_expert_gate=True,
    first_k_dense=1,
    aux_loss_coef=0.1,
    z_loss_coef=0.01,
)
SIGMOID_MODEL = MOE_MODEL.replace(moe_score="sigmoid", norm_topk=True, shared_expert_gate=False)


def _moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    shared = MLP(cfg, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
    moe = MoE(cfg, shared)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: its top-k experts' SwiGLU, weighted, plus the shared expert — no dispatch."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = moe.route(moe.gate(x[t : t + 1]))[0][0]
        top = torch.topk(scores, moe.top_k)
        weights = top.values / top.values.sum() if moe.norm_topk else top.values
        for w, e in zip(weights, top.indices, strict=True):
            ex = moe.experts
            h = F.silu(x[t] @ ex.gate_proj[e].T) * (x[t] @ ex.up_proj[e].T)
            out[t] += w * (h @ ex.down_proj[e].T)
        if moe.shared_expert is not None:
            shared = moe.shared_expert(x[t])
            if moe.shared_expert_gate is not None:
                shared = torch.sigmoid(moe.shared_expert_gate(x[t])) * shared
            out[t] += shared
    return out


# ---- routing and dispatch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [MOE_MODEL, SIGMOID_MODEL, MOE_MODEL.replace(top_k=4, norm_topk=True)])
def test_dispatch_equals_a_dense_per_token_computation(cfg: ModelConfig) -> None:
    moe = _moe(cfg).eval()
    x = torch.randn(2, 24, cfg.dim)
    with torch.no_grad():
        got = moe(x).view(-1, cfg.dim)
        want = naive_moe(moe, x.view(-1, cfg.dim))
    # fp32, the same products summed in a different order: ~1e-7 relative; a wrong expert or weight is O(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tokens_combined_in_the_wrong_order_fail_the_dispatch_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: the expert outputs go back to their (token, slot) rows shifted by one."""
    from meshlm.model import moe as moe_module

    original = moe_module.dispatch

    def shifted(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        order, counts = original(experts, n_experts)
        return order.roll(1), counts

    monkeypatch.setattr(moe_module, "dispatch", shifted)
    moe = _moe(MOE_MODEL).eval()
    x = torch.randn(1, 24, MOE_MODEL.dim)
    with torch.no_grad():
        got, want = moe(x).view(-1, MOE_MODEL.dim), naive_moe(moe, x.view(-1, MOE_MODEL.dim))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_is_dropless_when_every_token_picks_the_same_experts() -> None:
    """No capacity limit: with all 48 tokens sent to experts 0 and 1, each still gets both, in token order."""
    moe = _moe(MOE_MODEL)
    experts = torch.tensor([[1, 0]]).expand(48, 2)
    order, counts = dispatch(experts, 4)
    assert counts.tolist() == [48, 48, 0, 0]
    assert sorted(order.tolist()) == list(range(96))  # every (token, slot) exactly once
    x = torch.randn(48, MOE_MODEL.dim)
    weights = torch.full((48, 2), 0.5)
    got = combine(moe.experts, x, weights, experts, 4)
    ex = moe.experts
    want = sum(0.5 * (F.silu(x @ ex.gate_proj[e].T) * (x @ ex.up_proj[e].T)) @ ex.down_proj[e].T for e in (0, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")) or torch.cuda.get_device_capability() < (9, 0),
    reason="torch._grouped_mm needs a CUDA device of compute capability 9.0+",
)
def test_grouped_gemm_matches_the_expert_loop_on_cuda() -> None:
    """Under bf16 autocast the grouped GEMM path and the per-expert loop give the same outputs and gradients,
    up to bf16 rounding (relative 2^-8 per rounding, a few roundings deep)."""
    moe = _moe(MOE_MODEL).cuda()
    experts = torch.randint(0, 4, (96, 2), device="cuda")
    experts[:5] = 3  # one expert with more rows, and some experts maybe empty in other draws
    order, counts = dispatch(experts, 4)
    x = torch.randn(96 * 2, MOE_MODEL.dim, device="cuda")[order]
    results = []
    for path in (moe.experts.grouped, moe.experts.loop):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert grouped_mm_available(xi)
            y = path(xi, counts)
        y.float().pow(2).sum().backward()
        results.append((y.float(), xi.grad, moe.experts.gate_proj.grad.clone(), moe.experts.down_proj.grad.clone()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_unrouted_experts_get_zero_gradients() -> None:
    """Stacked weights: an expert no token chose has a zero gradient, not None (data parallel reduces all)."""
    moe = _moe(MOE_MODEL)
    combine(
        moe.experts, torch.randn(8, MOE_MODEL.dim), torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.long), 4
    ).sum().backward()
    grad = moe.experts.gate_proj.grad
    assert grad[0].abs().sum() > 0 and grad[1:].abs().sum() == 0


# ---- auxiliary losses -------------------------------------------------------------------------------------------
def test_balancing_loss_equals_transformers_mixtral() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    b, s, n_experts, k = 3, 20, 8, 2
    logits = torch.randn(b, s, n_experts) * 2
    probs = torch.softmax(logits, -1)
    experts = torch.topk(probs, k, dim=-1).indices
    got = load_balancing_loss(probs, experts, n_experts)
    # per sequence: HF's loss over that sequence's rows; meshlm's is their mean over the batch (docs/moe.md)
    per_sequence = [load_balancing_loss_func((logits[i],), n_experts, k) for i in range(b)]
    torch.testing.assert_close(got, torch.stack(per_sequence).mean(), rtol=1e-6, atol=0)
    one = load_balancing_loss(probs[:1], experts[:1], n_experts)
    torch.testing.assert_close(one, load_balancing_loss_func((logits[0],), n_experts, k), rtol=1e-6, atol=0)


def test_aux_losses_enter_the_gradient_scaled() -> None:
    """Backward through MoEAuxLossAutoScaler = backward of loss + scale · Σ_layers (aux_coef · aux + z_coef · z)."""
    torch.manual_seed(0)
    model = Transformer(MOE_MODEL).train()
    b, s = 2, 16
    tokens = torch.randint(0, MOE_MODEL.vocab_size, (b, s))
    scale = 0.25
    set_aux_loss_scale(model, scale)
    cross_entropy_loss(model(tokens), tokens).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    logits: list[torch.Tensor] = []
    for m in layers:  # the same model without the scaler, the penalty added to the loss by hand
        m.gate.register_forward_hook(lambda module, args, out: logits.append(out))
        m.aux_loss_coef = m.z_loss_coef = 0.0
    loss = cross_entropy_loss(model(tokens), tokens)
    for m, layer_logits in zip(layers, logits, strict=True):
        scores, _, experts = m.route(layer_logits)
        aux = load_balancing_loss(scores.view(b, s, -1), experts.view(b, s, -1), m.n_experts)
        loss = loss + scale * (MOE_MODEL.aux_loss_coef * aux + MOE_MODEL.z_loss_coef * router_z_loss(layer_logits))
    loss.backward()
    assert got["model.layers.1.mlp.gate.weight"].abs().sum() > 0
    for name, p in model.named_parameters():
        # the same sums in the same order, except the penalty's gradient joining the router's: fp32 rounding
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
    values = moe_losses(model)
    assert set(values) == {"moe_aux_loss", "moe_z_loss"}
    assert values["moe_aux_loss"] > 0 and values["moe_z_loss"] > 0


# ---- counts ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_parameter_counts_total_and_active(name: str) -> None:
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    counts = param_counts(cfg)
    assert model.num_params() == counts["total"]
    assert model.num_active_params() == counts["active"] < counts["total"]
    # MFU by active parameters: 6 · N_active (less the embedding lookup) + attention
    s = 1024
    attention = 3 * 4 * cfg.n_layers * s * cfg.n_heads * cfg.head_dim
    assert flops_per_token(cfg, s) == 6 * (counts["active"] - counts["embedding"] - _vectors(cfg)) + attention


def _vectors(cfg: ModelConfig) -> int:
    """Parameters outside matmuls: norm weights and q/k/v biases."""
    c = param_counts(cfg)
    norms = cfg.n_layers * (2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm else 0)) + cfg.dim
    return norms + cfg.n_layers * c["qkv_bias_per_layer"]


def test_published_sizes() -> None:
    """Mixtral 8x7B: 46.7B parameters, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B (their model cards)."""
    mixtral, qwen = param_counts(preset("mixtral-8x7b")), param_counts(preset("qwen3-30b-a3b"))
    assert round(mixtral["total"] / 1e9, 1) == 46.7 and round(mixtral["active"] / 1e9, 1) == 12.9
    assert round(qwen["total"] / 1e9, 1) == 30.5 and 3.3 <= qwen["active"] / 1e9 < 3.4


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.top_k", "9"], "model.top_k must be between 1 and model.n_experts (8), got 9"),
        (["--model.n_experts", "-1"], "model.n_experts"),
        (["--model.top_k", "0"], "model.top_k must be between 1 and model.n_experts (8), got 0"),
        (["--model.moe_intermediate_size", "0"], "model.moe_intermediate_size must be > 0"),
        (["--model.first_k_dense", "4"], "model.first_k_dense must be between 0 and model.n_layers - 1 (3)"),
        (["--model.moe_layer_step", "8"], "leaves no MoE layer"),
        (["--model.moe_score", "relu"], "model.moe_score"),
        (["--model.shared_expert_intermediate_size", "0"], "model.shared_expert_gate needs a shared expert"),
        (["--model.aux_loss_coef", "-1"], "model.aux_loss_coef"),
    ],
)
def test_bad_moe_config_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, parse_overrides(["--model.preset", "tiny-moe", *overrides])).model.build()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_k": 2}, "model.top_k (2) needs model.n_experts > 0"),
        ({"hf_model_type": "mixtral"}, "model.hf_model_type 'mixtral' needs model.n_experts > 0"),
        ({"n_experts": 4, "top_k": 1, "moe_intermediate_size": 8}, "needs a mixture-of-experts model.hf_model_type"),
    ],
)
def test_moe_fields_need_experts(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preset("test").replace(**changes)


def test_tensor_and_context_parallel_are_accepted_for_meshlms_moe_model() -> None:
    from meshlm.parallel.cp.attention import check_cp_plan

    with torch.device("meta"):
        model = Transformer(MOE_MODEL)
    plan = plan_for(model)
    check_cp_plan(model, plan)  # the balancing statistics are summed over the cp group
    options = ParallelOptions(zero=3, sequence_parallel=True)
    check_layout(LayoutSpec(None, Layout(tp=2, pp=2), 2, 1, options=options), model, plan)  # tp: test_moe_tp


# ---- training like one process -----------------------------------------------------------------------------------
RUNS = {  # name -> (layout, parallel, train_layout kwargs); every one compared with one process, no accumulation
    "dp2 zero1": ("dp=2", {"zero": 1}, {}),
    "dp2 zero3": ("dp=2", {"zero": 3}, {}),
    "dp2 zero1 accumulation": ("dp=2", {"zero": 1}, {"micro_batch": 2}),
    "pp2": ("pp=2", {}, {"micro_batch": 2}),
    "dp2 zero3 sgd": ("dp=2", {"zero": 3}, {"optimizer": "sgd"}),
    "dp2 sigmoid": ("dp=2", {"zero": 1}, {"model_cfg": SIGMOID_MODEL}),
    # each cp rank routes its shard of every sequence; the balancing statistics are summed over cp
    "cp2 ring zero1": ("cp=2", {"zero": 1}, {}),
    "cp2 ulysses sgd": ("cp=2", {"cp_attention": "ulysses"}, {"optimizer": "sgd"}),
}


@contextlib.contextmanager
def aux_gradient_dropped() -> Iterator[list]:
    """The bug: the aux losses are measured but their gradient never reaches the router."""
    fired: list = []
    original = MoEAuxLossAutoScaler.backward

    def backward(ctx, grad):
        fired.append(1)
        out = original(ctx, grad)
        return out[0], torch.zeros_like(out[1]), None

    MoEAuxLossAutoScaler.backward = staticmethod(backward)
    try:
        yield fired
    finally:
        MoEAuxLossAutoScaler.backward = staticmethod(original)


@contextlib.contextmanager
def aux_scale_not_per_micro_batch() -> Iterator[list]:
    """The bug: under gradient accumulation every micro-batch's aux gradient counts whole (scale 1, not 1/n_micro)."""
    from meshlm.parallel import engine

    fired: list = []
    original = engine.set_aux_loss_scale

    def unscaled(model: torch.nn.Module, scale: float) -> None:
        fired.append(scale)
        original(model, 1.0)

    engine.set_aux_loss_scale = unscaled
    try:
        yield fired
    finally:
        engine.set_aux_loss_scale = original


@contextlib.contextmanager
def balancing_statistics_per_cp_shard() -> Iterator[list]:
    """The bug: under cp each rank's balancing loss is built from its own shard of the sequences (the
    statistics are not summed over the cp group), so the aux term and its gradient differ."""
    from meshlm.parallel.cp import attention as context_parallel

    fired: list = []
    original = context_parallel.set_sequence_group

    def not_set(model: torch.nn.Module, group: object) -> None:
        fired.append(1)

    context_parallel.set_sequence_group = not_set
    try:
        yield fired
    finally:
        context_parallel.set_sequence_group = original


def world2_job(checkpoint_dir: str) -> dict:
    out = {"saved": train_layout("dp=2", {"zero": 3}, model_cfg=MOE_MODEL, stop=5, save_to=checkpoint_dir)}
    for name, (layout, parallel, kwargs) in RUNS.items():
        out[name] = train_layout(layout, parallel, **{"model_cfg": MOE_MODEL, **kwargs})
    with aux_gradient_dropped() as fired:
        out["mutated"] = train_layout("dp=2", {"zero": 1}, model_cfg=MOE_MODEL)
    out["mutated"]["fired"] = len(fired)
    with aux_scale_not_per_micro_batch() as fired:
        out["unscaled"] = train_layout("dp=2", {"zero": 1}, model_cfg=MOE_MODEL, micro_batch=2)
    out["unscaled"]["fired"] = len(fired)
    with balancing_statistics_per_cp_shard() as fired:
        out["cp per shard"] = train_layout("cp=2", {"zero": 1}, model_cfg=MOE_MODEL)
    out["cp per shard"]["fired"] = len(fired)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe-checkpoint"))


@pytest.fixture(scope="module")
def world2(checkpoint_dir: str) -> dict:
    return run_shared(world2_job, 2, checkpoint_dir, timeout=600)[0]


def _reference(kwargs: dict) -> dict:
    args = {"model_cfg": MOE_MODEL, **{k: v for k, v in kwargs.items() if k != "micro_batch"}}
    return reference(**args)


@pytest.mark.slow  # eight 10-step runs on two ranks of a 4-expert model: ~40 s on 2 cores
@pytest.mark.parametrize("name", list(RUNS))
def test_moe_trains_like_one_process(world2: dict, name: str) -> None:
    assert_close_runs(_reference(RUNS[name][2]), world2[name])


@pytest.mark.slow  # shares the fixture above
@pytest.mark.parametrize("bug", ["mutated", "unscaled", "cp per shard"])
def test_aux_gradient_bugs_fail_the_loss_criterion(world2: dict, bug: str) -> None:
    """A missing aux-loss gradient, one not divided by the micro-batch count, and under cp a balancing loss
    built from each rank's shard of the sequences change the loss curve."""
    got = world2[bug]
    assert got["fired"]
    assert "losses" in criterion_failures(_reference({}), got)


@pytest.mark.slow  # trains a tokenizer and 40 steps of tiny-moe on real text: minutes on 2 cores
def test_tiny_moe_preset_trains_and_logs_its_aux_losses(small_run: list[str]) -> None:
    """`meshlm train --model.preset tiny-moe` (with the demo's 512-token vocabulary): the validation loss falls
    by more than a nat in 40 steps, and the logged aux losses are those of a routed model."""
    import json
    import math
    from pathlib import Path

    from meshlm.train.trainer import train

    overrides = ["--model.preset", "tiny-moe", "--model.vocab_size", "512", "--data.seq_len", "128"]
    overrides += ["--train.steps", "40", "--train.eval_every", "40", "--train.warmup_steps", "5"]
    cfg = load_config(None, parse_overrides([*small_run, *overrides, "--checkpoint.every", "0", "--log.every", "10"]))
    result = train(cfg)
    (_, first), (_, last) = result.eval_losses[0], result.eval_losses[-1]
    assert first == pytest.approx(math.log(512), abs=0.2)
    assert last < first - 1.0
    lines = [json.loads(line) for line in (Path(cfg.log.run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if line.get("kind") == "train" and "moe_aux_loss" in line]
    assert logged and all(line["moe_aux_loss"] >= 1.0 and line["moe_z_loss"] > 0 for line in logged)


@pytest.mark.slow  # shares the fixture above
def test_zero3_checkpoint_of_stacked_experts_resumes_in_one_process(world2: dict, checkpoint_dir: str) -> None:
    """Saved at dp=2 ZeRO-3 after 5 steps (experts flat-sharded over both ranks), resumed in one process: the
    weights load bit for bit and the last 5 steps continue the one-process curve."""
    resumed = train_layout("", model_cfg=MOE_MODEL, start=5, resume_from=checkpoint_dir)
    assert_identical_weights(world2["saved"]["state"], resumed["resumed_state"])
    assert_close_runs(tail(_reference({}), 5), resumed)
