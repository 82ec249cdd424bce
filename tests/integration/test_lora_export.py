"""LoRA adapters out and in: PEFT directories that `peft` loads onto the transformers base with the logits
meshlm computes (fp32, 1e-5 relative: the same matmuls in another order, ~1e-7), merged weights equal to
W + B·A·alpha/rank, `lora.init_from`, and `meshlm train --lora.rank` whose checkpoints hold only the adapters
and which `meshlm convert` exports either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.model import Transformer, preset
from meshlm.model.hf_export import export_hf
from meshlm.parallel.transforms.lora import (
    LoRAError,
    apply_lora,
    export_peft,
    load_adapter,
    lora_spec,
    merge_lora,
    merged_state_dict,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MODEL = preset("test")
RTOL = 1e-5  # fp32 logits of the same model computed by two libraries: rounding differs by ~1e-7 relative


def randomize_adapters(model: torch.nn.Module) -> None:
    """Non-zero B (it starts at zero), so the adapters change the logits."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def assert_close_logits(want: torch.Tensor, got: torch.Tensor) -> None:
    err = (want - got).abs().max().item()
    assert err <= RTOL * want.abs().max().item(), err


def tokens() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_peft_export_of_meshlm_llama_loads_in_peft_with_equal_logits(tmp_path: Path) -> None:
    base = Transformer(MODEL, init_seed=0)
    export_hf(base, tmp_path / "base")
    model = Transformer(MODEL, init_seed=0)
    apply_lora(model, 4, 8.0, seed=2)
    randomize_adapters(model)
    want = model(tokens())
    export_peft(model.state_dict(), lora_spec(model), tmp_path / "adapter", str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7 * MODEL.n_layers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert_close_logits(want, adapted(tokens()).logits)
    # The adapters matter: the base alone is far off.
    assert (want - base(tokens())).abs().max() > 100 * RTOL * want.abs().max()


@torch.no_grad()
def test_peft_export_of_an_hf_llama_object_loads_in_peft_with_equal_logits(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=MODEL.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, 2, 4.0, seed=3)
    randomize_adapters(model)
    want = model(tokens()).logits
    export_peft(model.state_dict(), lora_spec(model), tmp_path / "adapter")
    fresh = transformers.LlamaForCausalLM(config).eval()
    fresh.load_state_dict(base_state)
    adapted = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert_close_logits(want, adapted(tokens()).logits)


@torch.no_grad()
def test_merge_is_base_plus_scaled_product_and_keeps_the_logits() -> None:
    model = Transformer(MODEL, init_seed=0)
    apply_lora(model, 4, 8.0, seed=2)
    randomize_adapters(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = model(tokens())
    merged = merged_state_dict(state, 8.0 / 4)
    name = "model.layers.1.mlp.down_proj"
    expected = state[f"{name}.weight"] + state[f"{name}.lora_B"] @ state[f"{name}.lora_A"] * 2.0
    assert torch.equal(merged[f"{name}.weight"], expected)
    assert not any(".lora_" in k for k in merged)
    assert_close_logits(want, merge_lora(model)(tokens()))
    plain = Transformer(MODEL, init_seed=0)
    plain.load_state_dict(merged)
    assert_close_logits(want, plain(tokens()))


@torch.no_grad()
def test_adapter_round_trip_and_a_different_base_is_one_line(tmp_path: Path) -> None:
    model = Transformer(MODEL, init_seed=0)
    apply_lora(model, 4, 8.0, seed=2)
    randomize_adapters(model)
    export_peft(model.state_dict(), lora_spec(model), tmp_path / "adapter")
    again = Transformer(MODEL, init_seed=0)
    apply_lora(again, 4, 8.0, seed=9)
    load_adapter(again, tmp_path / "adapter")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())

    wider = Transformer(MODEL.replace(dim=128, n_heads=4), init_seed=0)
    apply_lora(wider, 4, 8.0)
    with pytest.raises(LoRAError, match="an adapter for a different base") as e:
        load_adapter(wider, tmp_path / "adapter")
    assert "\n" not in str(e.value)
    fewer = Transformer(MODEL.replace(n_layers=2), init_seed=0)
    apply_lora(fewer, 4, 8.0)
    with pytest.raises(LoRAError, match="different base"):
        load_adapter(fewer, tmp_path / "adapter")
    other_rank = Transformer(MODEL, init_seed=0)
    apply_lora(other_rank, 8, 8.0)
    with pytest.raises(LoRAError, match=r"has rank 4, alpha 8\.0; this run has lora\.rank 8"):
        load_adapter(other_rank, tmp_path / "adapter")


# ---- meshlm train --lora.rank, its checkpoints and meshlm convert -----------------------------------------
TEXT = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(60)]


def lora_overrides(root: Path, run_dir: Path, steps: int = 2) -> list[tuple[str, object]]:
    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, text in enumerate(TEXT):
        (corpus / f"doc{i:03d}.txt").write_text(text)
    return list(
        {
            "model.preset": "test",
            "data.source": str(corpus),
            "data.cache_dir": str(root / "cache"),
            "data.seq_len": 16,
            "data.val_fraction": 0.1,
            "train.steps": steps,
            "train.global_batch": 4,
            "train.eval_every": 0,
            "train.device": "cpu",
            "train.lr": 0.03,
            "checkpoint.async_save": False,
            "log.run_dir": str(run_dir),
            "log.tensorboard": False,
            "log.progress": False,
            "lora.rank": 4,
            "lora.alpha": 8.0,
        }.items()
    )


@pytest.mark.slow  # tokenizer training and a real run: ~12 s on a 2-vCPU VM
@torch.no_grad()
def test_lora_run_checkpoints_adapters_only_and_converts_both_ways(tmp_path: Path) -> None:
    from meshlm.checkpoint import latest_valid_checkpoint, load_model_state
    from meshlm.cli import main
    from meshlm.train.trainer import fit

    run_dir = tmp_path / "run"
    cfg = load_config(None, lora_overrides(tmp_path, run_dir))
    with torch.enable_grad():
        fit(cfg)
    state = load_model_state(latest_valid_checkpoint(run_dir))
    assert state and all(".lora_" in k for k in state), sorted(state)[:3]

    assert main(["convert", "meshlm-to-hf", str(run_dir), str(tmp_path / "adapter"), "--lora", "peft"]) == 0
    assert main(["convert", "meshlm-to-hf", str(run_dir), str(tmp_path / "merged")]) == 0
    base = Transformer(cfg.model.build(), init_seed=cfg.train.seed)
    export_hf(base, tmp_path / "base")
    scaling = 8.0 / 4
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, p in base.named_parameters():
        module = name.removesuffix(".weight")
        want = p + state[f"{module}.lora_B"] @ state[f"{module}.lora_A"] * scaling if f"{module}.lora_A" in state else p
        assert torch.allclose(merged[name], want, rtol=0, atol=1e-6), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    assert_close_logits(plain(tokens()).logits, adapted(tokens()).logits)
