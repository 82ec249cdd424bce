"""Hugging Face families beyond plain Llama: Llama 3.1 `llama3` RoPE scaling with tied embeddings, an explicit
head_dim, Qwen2's q/k/v biases and Mistral's sliding window. For each, a random-weight transformers model
built from a config goes through `meshlm convert` both ways: meshlm's fp32 logits equal transformers' (max
|d| <= 1e-4), and the export loads into the same transformers class with the same logits. What is still
unsupported is refused with one line; biased and wide-head models train under tp=2 as in one process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from distributed import run_shared
from equivalence import TEST_MODEL, assert_close_runs, reference, train_layout

from meshlm.cli import add_convert_parser
from meshlm.config import ConfigError, load_config
from meshlm.convert import run_convert
from meshlm.model import ModelConfig, Transformer, flops_per_token, param_counts
from meshlm.model.config import LLAMA3_ROPE_FIELDS
from meshlm.model.flops import matmul_params
from meshlm.model.hf import load_hf_into_model, model_config_from_hf
from meshlm.model.hf_export import hf_config_from_model

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, TOLERANCE = 128, 32, 1e-4
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}
# head_dim 16 and theta 5e5: wavelengths 6.3, 32.5, 167, ... With original 64 / high 4 = 16 and 64 / low 1 = 64,
# the first frequency is kept, the second interpolated and the rest divided by the factor: every branch.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama3.1-tied": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3, tie_word_embeddings=True),
    "llama-head_dim": lambda: transformers.LlamaConfig(**COMMON, head_dim=24),
    "qwen2-bias": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, sliding_window=SEQ),
}
EXPECTED = {  # the ModelConfig fields each family must import as
    "llama3.1-tied": {
        "rope_type": "llama3",
        "rope_factor": 8.0,
        "rope_original_max_seq_len": 64,
        "tie_embeddings": True,
    },
    "llama-head_dim": {"head_dim_override": 24, "hf_model_type": "llama"},
    "qwen2-bias": {"qkv_bias": True, "hf_model_type": "qwen2", "tie_embeddings": True},
    "mistral-window": {"sliding_window": SEQ, "hf_model_type": "mistral"},
}


def make_hf_model(family: str) -> torch.nn.Module:
    """Weights large enough that attention is sharp, non-unit norms and non-zero biases, so a wrong RoPE, a
    missing bias or a misread head width shows in the logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def tokens(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def max_diff(hf_model: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor) -> float:
    return (hf_model(x).logits - model(x)).abs().max().item()


def convert(*args: str) -> None:
    parser = argparse.ArgumentParser(prog="meshlm")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    assert run_convert(parser.parse_args(["convert", *args])) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_family_round_trip_matches_transformers(family: str, tmp_path: Path) -> None:
    hf_model = make_hf_model(family)
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_hf_into_model(tmp_path / "hf").eval()
    assert {k: getattr(model.cfg, k) for k in EXPECTED[family]} == EXPECTED[family]
    x = tokens()
    imported = max_diff(hf_model, model, x)
    assert imported <= TOLERANCE, f"{family}: import max |d| = {imported}"

    # meshlm file (config in its metadata, read back through the [model] section) -> HF directory.
    convert("hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "m.safetensors"))
    convert("meshlm-to-hf", str(tmp_path / "m.safetensors"), str(tmp_path / "out"))
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(exported) is type(hf_model)
    assert model_config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == model.cfg
    round_trip = max_diff(exported.eval(), model, x)
    assert round_trip <= TOLERANCE, f"{family}: export max |d| = {round_trip}"
    print(f"{family}: import max |d| = {imported:.2e}, export max |d| = {round_trip:.2e}")


def imported(family: str, directory: Path) -> tuple[torch.nn.Module, Transformer]:
    hf_model = make_hf_model(family)
    hf_model.save_pretrained(directory)
    return hf_model, load_hf_into_model(directory).eval()


@pytest.mark.parametrize("family", ["llama3.1-tied", "qwen2-bias"])
def test_the_comparison_is_sharp(family: str, tmp_path: Path) -> None:
    """Without the llama3 frequency scaling, or with the Qwen2 biases zeroed, meshlm's logits are far from
    transformers' (an explicit head_dim changes the shapes, which import checks)."""
    hf_model, model = imported(family, tmp_path)
    assert max_diff(hf_model, model, tokens()) <= TOLERANCE
    if family == "qwen2-bias":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    else:
        unscaled = Transformer(model.cfg.replace(rope_type="default", **dict.fromkeys(LLAMA3_ROPE_FIELDS, 0)))
        unscaled.load_state_dict(model.state_dict())
        model = unscaled.eval()
    assert max_diff(hf_model, model, tokens()) > 1e-2


def test_mistral_window_equals_full_attention_up_to_its_length(tmp_path: Path) -> None:
    """At seq_len == window the logits match (above); one token more, transformers masks position 0 from the
    last position and full attention does not, so meshlm refuses it."""
    hf_model, model = imported("mistral-window", tmp_path)
    longer = tokens(SEQ + 1)
    with pytest.raises(ValueError, match=rf"sequence length {SEQ + 1} exceeds model\.sliding_window {SEQ}$"):
        model(longer)
    unwindowed = Transformer(model.cfg.replace(sliding_window=0)).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        last = (hf_model(longer).logits - unwindowed(longer)).abs()[:, -1].max().item()
        earlier = (hf_model(longer).logits - unwindowed(longer)).abs()[:, :-1].max().item()
    assert earlier <= TOLERANCE < 1e-2 < last


def hf_config(**changes: object) -> dict:
    base = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)
    return hf_config_from_model(base) | changes


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (hf_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type='yarn'"),
        (hf_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
        (
            hf_config(rope_parameters={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
            "rope_parameters.factor is missing (rope_type 'llama3' needs it)",
        ),
        (
            hf_config(rope_parameters=LLAMA3 | {"high_freq_factor": 1.0}),
            "rope_parameters.high_freq_factor (1.0) must exceed rope_parameters.low_freq_factor (1.0)",
        ),
        (hf_config(mlp_bias=True), "mlp_bias=True is not supported by meshlm"),
        (hf_config(attention_bias=True), "attention_bias=True is not supported by meshlm"),
        (hf_config(model_type="gemma"), "model_type='gemma' is not supported by meshlm"),
        (hf_config(head_dim=15), "head_dim = 15 must be even"),
        (
            hf_config(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
            "use_sliding_window=True is not supported by meshlm (needs false, or sliding_window (16) >= "
            "max_position_embeddings (256); 1 of 2 layers",
        ),
        (
            hf_config(model_type="qwen2", use_sliding_window=True, layer_types=["full_attention", "chunked"]),
            "layer_types=['full_attention', 'chunked'] should list num_hidden_layers (2)",
        ),
        (hf_config(model_type="mistral", sliding_window=0), "sliding_window=0 should be a positive integer"),
    ],
)
def test_unsupported_is_refused_in_one_line(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        model_config_from_hf(config)
    assert str(info.value).startswith("config.json: ") and "\n" not in str(info.value), str(info.value)
    assert message in str(info.value), str(info.value)


def test_windows_and_defaults_that_match_full_attention_are_accepted() -> None:
    qwen2 = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}
    # Qwen2 slides only from max_window_layers (default 28) on, or with a window covering every position.
    assert model_config_from_hf(hf_config(**qwen2)).sliding_window == 0
    assert model_config_from_hf(hf_config(**qwen2 | {"max_window_layers": 0, "sliding_window": 256})).qkv_bias
    # Absent and null differ as in transformers: Mistral's window defaults to 4096, null is none.
    mistral = {k: v for k, v in hf_config(model_type="mistral").items() if k != "sliding_window"}
    assert model_config_from_hf(mistral).sliding_window == 4096
    assert model_config_from_hf(mistral | {"sliding_window": None}).sliding_window == 0
    # transformers 4 style llama3 scaling: under rope_scaling, original length defaulting to max positions.
    v4 = hf_config(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1, "high_freq_factor": 4})
    assert model_config_from_hf(v4).llama3_rope == (32.0, 1.0, 4.0, 256)


def test_mistral_window_shorter_than_seq_len_is_refused_in_one_line() -> None:
    mistral = [("model.hf_model_type", "mistral"), ("data.seq_len", 64)]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*mistral, ("model.sliding_window", 32)])
    assert str(info.value).startswith("config error: data.seq_len (64) exceeds model.sliding_window (32)")
    assert "\n" not in str(info.value)
    assert load_config(None, [*mistral, ("model.sliding_window", 64)]).model.build().sliding_window == 64


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qkv_bias": True}, "model.qkv_bias=True does not fit model.hf_model_type 'llama'"),
        ({"hf_model_type": "qwen2"}, "model.qkv_bias=False does not fit model.hf_model_type 'qwen2'"),
        ({"sliding_window": 64}, "model.sliding_window needs model.hf_model_type 'mistral'"),
        ({"rope_factor": 8.0}, "model.rope_factor (8.0) needs model.rope_type 'llama3'"),
        (
            {"rope_type": "llama3", "rope_factor": 8.0},
            "model.rope_low_freq_factor must be set (> 0) with model.rope_type",
        ),
        ({"rope_type": "yarn"}, "model.rope_type: unknown type 'yarn'"),
        ({"head_dim_override": 7}, "model.head_dim_override = 7 must be even"),
        ({"sliding_window": -1}, "model.sliding_window must be >= 0 (0: unset), got -1"),
        ({"hf_model_type": "gemma"}, "model.hf_model_type: unknown family 'gemma'"),
    ],
)
def test_model_config_refuses_what_export_cannot_write(changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        TEST_MODEL.replace(**changes)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


QKV = TEST_MODEL.replace(qkv_bias=True, hf_model_type="qwen2", n_kv_heads=1)  # tp=2 replicates the KV head
WIDE = TEST_MODEL.replace(head_dim_override=24)  # 4 heads of 24 on a 64-wide residual
SCALED = TEST_MODEL.replace(
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_seq_len=16,
)


def test_biases_start_at_zero_and_counts_follow_the_shape() -> None:
    for cfg in (QKV, WIDE, SCALED):
        model = Transformer(cfg)
        assert model.num_params() == param_counts(cfg)["total"]
        biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
        assert len(biases) == (3 * cfg.n_layers if cfg.qkv_bias else 0)
        assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)
    # Biases are not matmul weights; attention FLOPs follow n_heads × head_dim, not dim.
    assert matmul_params(QKV) == matmul_params(QKV.replace(qkv_bias=False, hf_model_type="llama"))
    attention = 4 * WIDE.n_layers * 32 * WIDE.n_heads * 24
    assert flops_per_token(WIDE, 32, training=False) == 2 * matmul_params(WIDE) + attention


def _train_runs(runs: list[tuple[str, dict, dict]]) -> list[dict]:
    return [train_layout(layout, parallel, **kwargs) for layout, parallel, kwargs in runs]


def test_bias_and_head_dim_models_train_under_tp2_as_in_one_process() -> None:
    runs = [
        ("tp=2", {}, {"model_cfg": QKV}),
        ("tp=2", {}, {"model_cfg": QKV, "optimizer": "sgd"}),  # final weights, the biases included
        ("tp=2", {"sequence_parallel": True}, {"model_cfg": WIDE, "optimizer": "sgd"}),
    ]
    results = run_shared(_train_runs, 2, runs)[0]
    for (_, _, kwargs), got in zip(runs, results, strict=True):
        ref = reference(**kwargs)
        assert_close_runs(ref, got)
        if kwargs["model_cfg"] is QKV and kwargs.get("optimizer") == "sgd":
            assert ref["moved"]["model.layers.0.self_attn.k_proj.bias"] > 0  # the biases did train
