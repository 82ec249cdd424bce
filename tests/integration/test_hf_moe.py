"""Hugging Face MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM in and out of meshlm: logits
equal to transformers', per-expert tensors stacked and unstacked, `model.init_from` reading expert slices,
one-line refusals, and the HF module trees trained under ZeRO-3 like one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_shared

from meshlm.model import Transformer
from meshlm.model.hf import import_hf, load_hf_into_model, model_config_from_hf, read_hf_config
from meshlm.model.hf_export import export_hf
from meshlm.model.pretrained import HFWeights
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import PlanError
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.strategies import check_layout

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 24
# fp32 throughout: the same sums in another order differ by ~1e-6 of the logits' scale (measured 3e-7);
# a wrong expert, router, norm or bias moves them by O(1) (test_the_comparison_is_sharp)
RTOL = 1e-4
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "mlp_only_layers": [0],
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "norm_topk_prob": True},
    ),
}


def make_hf_model(family: str) -> torch.nn.Module:
    """Random weights large enough that routing and attention are sharp, non-unit norms, non-zero biases."""
    config_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def rel_diff(hf_model: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor) -> float:
    want = hf_model(x).logits
    return ((want - model(x)).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        out[family] = tmp_path_factory.mktemp(family)
        make_hf_model(family).save_pretrained(out[family])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_match_transformers(family: str, saved: dict[str, Path], tmp_path: Path) -> None:
    hf_model = make_hf_model(family)
    model = load_hf_into_model(saved[family]).eval()
    assert model.cfg.hf_model_type == family and model.cfg.n_experts == 4
    x = tokens()
    assert rel_diff(hf_model, model, x) <= RTOL

    export_hf(model, tmp_path)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(exported) is type(hf_model)
    assert model_config_from_hf(json.loads((tmp_path / "config.json").read_text())) == model.cfg
    assert rel_diff(exported.eval(), model, x) <= RTOL


def test_layer_kinds_follow_the_config(saved: dict[str, Path]) -> None:
    cfg = read_hf_config(saved["qwen2_moe"])
    assert (cfg.first_k_dense, cfg.moe_layers, cfg.shared_expert_gate, cfg.qkv_bias) == (1, (1, 2), True, True)
    cfg = read_hf_config(saved["qwen3_moe"])
    assert (cfg.qk_norm, cfg.norm_topk, cfg.top_k, cfg.moe_layers) == (True, True, 3, (0, 1, 2))
    assert read_hf_config(saved["mixtral"]).moe_intermediate_size == COMMON["intermediate_size"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_comparison_is_sharp(family: str, saved: dict[str, Path]) -> None:
    """Two experts' weights swapped (a wrong stacking order) change the logits far beyond the tolerance."""
    hf_model = make_hf_model(family)
    model = load_hf_into_model(saved[family]).eval()
    layer = model.model.layers[str(model.cfg.moe_layers[0])].mlp.experts
    with torch.no_grad():
        layer.down_proj[[0, 1]] = layer.down_proj[[1, 0]].clone()
    assert rel_diff(hf_model, model, tokens()) > 100 * RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_reads_flat_ranges_across_experts(family: str, saved: dict[str, Path]) -> None:
    """ZeRO-3 asks for a flat range of a stacked weight: the experts it covers are read and sliced."""
    _, state = import_hf(saved[family])
    weights = HFWeights(saved[family])
    gen = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        flat = tensor.reshape(-1)
        for _ in range(3):
            start = int(torch.randint(0, flat.numel(), (1,), generator=gen))
            stop = int(torch.randint(start + 1, flat.numel() + 1, (1,), generator=gen))
            out = torch.empty(stop - start)
            weights.fill(name, tensor.shape, tensor.shape, None, start, out)
            assert torch.equal(out, flat[start:stop]), name
    weights.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_reads_expert_slices_over_ep_and_tp(family: str, saved: dict[str, Path]) -> None:
    """Under ep × tp a rank holds some experts (dim 0) and a tp-th of their hidden units (dim 1 of gate/up,
    dim 2 of down): the source reads exactly that slice, from any flat start."""
    _, state = import_hf(saved[family])
    weights = HFWeights(saved[family])
    stacked = {name: t for name, t in state.items() if t.ndim == 3}
    assert stacked
    for name, tensor in stacked.items():
        hidden_dim = 2 if name.endswith("down_proj") else 1
        experts, width = tensor.shape[0] // 2, tensor.shape[hidden_dim] // 2
        part = tensor.narrow(0, experts, experts).narrow(hidden_dim, width, width)
        flat = part.reshape(-1)
        for start in (0, flat.numel() // 3):
            out = torch.empty(flat.numel() - start)
            weights.fill(name, tensor.shape, part.shape, ((0, experts), (hidden_dim, width)), start, out)
            assert torch.equal(out, flat[start:]), name
    weights.close()


def hf_config(family: str, **changes: object) -> dict:
    config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **fields).to_dict()
    return {**config, **changes}


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported by meshlm (needs 0)"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] is not supported"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds num_local_experts (4)"),
        ("qwen2_moe", {"qkv_bias": False}, "qkv_bias=False is not supported"),
        ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "num_local_experts=0 should be a positive integer"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(family: str, changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        model_config_from_hf(hf_config(family, **changes))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("qwen3_moe", {"moe_score": "sigmoid"}, "model.moe_score='sigmoid' cannot be exported as Qwen3MoeForCausalLM"),
        ("mixtral", {"norm_topk": False}, "model.norm_topk=False cannot be exported as MixtralForCausalLM"),
        ("qwen2_moe", {"shared_expert_gate": False}, "model.shared_expert_gate=False cannot be exported"),
    ],
)
def test_export_refuses_what_the_family_cannot_hold(
    family: str, changes: dict, message: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    cfg = read_hf_config(saved[family]).replace(**changes)
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        export_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_hf_moe_plans_refuse_tensor_parallel_in_one_line() -> None:
    for family in FAMILIES:
        model = make_hf_model(family)
        plan = plan_for(model)
        assert plan.name == "hf-moe"
        with pytest.raises(PlanError, match=r"^tp=2: tensor parallelism does not split mixture-of-experts layers"):
            check_layout(LayoutSpec(None, Layout(tp=2), 1, options=ParallelOptions(zero=3)), model, plan)
        check_layout(LayoutSpec(None, Layout(), 1, options=ParallelOptions(zero=3)), model, plan)


# ---- the HF module trees under data parallel / ZeRO --------------------------------------------------------------
STEPS, BATCH = 10, 8


def train_hf(family: str, layout: str, zero: int) -> list[float]:
    """Ten AdamW steps of the HF model (its own forward, meshlm's ParallelModel around it) on fixed batches."""
    import torch.distributed as dist

    from meshlm.parallel.engine import parallelize
    from meshlm.parallel.mesh import build_mesh, parse_layout

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lay = parse_layout(layout, dist.get_world_size())
    model = make_hf_model(family).train()
    pm = parallelize(model, build_mesh(lay, "cpu"), {"zero": zero})
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, foreach=True)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        rows = slice(pm.mesh.rank("dp") * BATCH // lay.dp, (pm.mesh.rank("dp") + 1) * BATCH // lay.dp)
        losses.append(pm.forward_backward(x[rows, :-1], x[rows, 1:]).item())
        pm.clip_grad_norm_(1.0)
        pm.step(opt)
    return losses


def _hf_runs() -> dict[str, list[float]]:
    return {family: train_hf(family, "dp=2", zero=3) for family in FAMILIES}


@pytest.mark.slow  # three 10-step runs on two ranks: ~15 s on 2 cores
def test_hf_moe_trains_under_zero3_like_one_process() -> None:
    got = run_shared(_hf_runs, 2, timeout=600)[0]
    for family in FAMILIES:
        want = train_hf(family, "", zero=0)
        for step, (a, b) in enumerate(zip(want, got[family], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(a), f"{family} step {step}: {b} vs one process {a}"
