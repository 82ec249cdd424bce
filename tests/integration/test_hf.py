"""HF Llama import/export: logits must match transformers' own LlamaForCausalLM exactly (to 1e-5)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from meshlm.cli import add_convert_parser  # noqa: E402
from meshlm.convert import run_convert  # noqa: E402
from meshlm.model.config import ModelConfig  # noqa: E402
from meshlm.model.hf import import_hf, load_hf_into_model, model_config_from_hf  # noqa: E402
from meshlm.model.hf_export import export_hf, hf_config_from_model  # noqa: E402
from meshlm.model.llama import Transformer  # noqa: E402

VOCAB, SEQ = 128, 16


def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that attention is sharp, so a wrong RoPE or mapping shows in the logits,
    and non-unit norm weights, so swapped norms show too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)


def make_hf_model(tie: bool = False, rope_theta: float = 10000.0):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_(model)
    return model


def make_meshlm_model(**changes: object) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96, max_seq_len=32
    )
    torch.manual_seed(1)
    model = Transformer(cfg.replace(**changes)).eval()
    randomize_(model)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def max_logit_diff(hf_model, model: Transformer) -> float:
    x = tokens()
    return (hf_model(x).logits - model(x)).abs().max().item()


def load_hf(directory: Path):
    hf_model, info = transformers.LlamaForCausalLM.from_pretrained(
        directory, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf_model.eval()


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    make_hf_model().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(("tie", "rope_theta"), [(False, 10000.0), (True, 10000.0), (False, 500.0)])
def test_import_matches_hf_logits(tmp_path: Path, tie: bool, rope_theta: float) -> None:
    hf_model = make_hf_model(tie, rope_theta)
    hf_model.save_pretrained(tmp_path)
    cfg, state = import_hf(tmp_path)
    assert (cfg.tie_embeddings, cfg.rope_theta, cfg.n_kv_heads, cfg.norm_eps) == (tie, rope_theta, 2, 1e-5)
    assert state.keys() == Transformer(cfg).state_dict().keys()
    model = load_hf_into_model(tmp_path).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert max_logit_diff(hf_model, model) < 1e-5


def test_import_hf_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = make_hf_model()
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert max_logit_diff(hf_model, load_hf_into_model(tmp_path).eval()) < 1e-5


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "rope_theta": 500.0}])
def test_export_loads_in_transformers(tmp_path: Path, changes: dict) -> None:
    model = make_meshlm_model(**changes)
    export_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] == model.cfg.tie_embeddings
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) != model.cfg.tie_embeddings
    assert max_logit_diff(load_hf(tmp_path), model) < 1e-5


def test_sharded_export_loads_in_transformers_and_meshlm(tmp_path: Path) -> None:
    model = make_meshlm_model()
    export_hf(model, tmp_path, max_shard_bytes=30_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    for shard in shards:  # only a tensor bigger than the limit may exceed it, and then alone
        tensors = load_file(shard)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 30_000
    assert max_logit_diff(load_hf(tmp_path), model) < 1e-5
    _, state = import_hf(tmp_path)
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())

    export_hf(model, tmp_path)  # re-export unsharded: the old shards must not linger
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_export_bfloat16(tmp_path: Path) -> None:
    model = make_meshlm_model()
    export_hf(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, state = import_hf(tmp_path)
    assert all(torch.equal(state[n], t.bfloat16()) for n, t in model.state_dict().items())


def test_config_round_trip_and_transformers_versions() -> None:
    cfg = make_meshlm_model(rope_theta=500.0, norm_eps=1e-6, init_std=0.01).cfg
    hf_config = hf_config_from_model(cfg)
    assert model_config_from_hf(hf_config) == cfg
    llama_config = transformers.LlamaConfig(**hf_config)
    assert llama_config.rope_parameters["rope_theta"] == 500.0
    assert (llama_config.head_dim, llama_config.num_key_value_heads) == (16, 2)
    # transformers 4 style: rope_theta at top level, rope_scaling null, no rope_parameters.
    v4 = {k: v for k, v in hf_config.items() if k != "rope_parameters"} | {"rope_scaling": None}
    assert model_config_from_hf(v4) == cfg
    # transformers 5 style: rope_theta only inside rope_parameters.
    v5 = {k: v for k, v in hf_config.items() if k != "rope_theta"}
    assert model_config_from_hf(v5) == cfg


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 15}, "head_dim"),
        ({"model_type": "gemma"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_config_fields_are_refused(changes: dict, field: str) -> None:
    hf_config = hf_config_from_model(make_meshlm_model().cfg) | changes
    hf_config = {k: v for k, v in hf_config.items() if v is not None}
    with pytest.raises(ValueError, match=f"config.json: .*{field}"):
        model_config_from_hf(hf_config)


def test_import_error_names_config_file(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text()) | {"attention_bias": True}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"hf: config\.json: attention_bias=True is not supported"):
        import_hf(hf_dir)


def rewrite_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor model\.layers\.1\.mlp\.up_proj"):
        import_hf(hf_dir)


def test_wrong_shape(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape"
    ):
        import_hf(hf_dir)


def test_unexpected_tensor_and_ignored_inv_freq(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    import_hf(hf_dir)
    rewrite_weights(hf_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor model\.layers\.0\.self_attn"):
        import_hf(hf_dir)


def test_shard_missing_a_listed_tensor(tmp_path: Path) -> None:
    export_hf(make_meshlm_model(), tmp_path, max_shard_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=rf"{shard.name}: missing tensor model\.norm\.weight \(listed in"):
        import_hf(tmp_path)


def test_no_safetensors_and_partial_model(tmp_path: Path) -> None:
    model = make_meshlm_model()
    export_hf(model, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        import_hf(tmp_path)
    model.lm_head = None  # as on a pipeline stage that does not own the head
    with pytest.raises(ValueError, match=r"export_hf .*: missing tensor lm_head\.weight"):
        export_hf(model, tmp_path)


def test_cli_round_trip(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="meshlm")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    meshlm_file, out_dir = tmp_path / "ckpt.safetensors", tmp_path / "hf_out"

    assert run_convert(parser.parse_args(["convert", "hf-to-meshlm", str(hf_dir), str(meshlm_file)])) == 0
    to_hf = ["convert", "meshlm-to-hf", str(meshlm_file), str(out_dir), "--max-shard-bytes", "30000"]
    assert run_convert(parser.parse_args(to_hf)) == 0
    assert (out_dir / "model.safetensors.index.json").exists()
    assert max_logit_diff(load_hf(out_dir), load_hf_into_model(hf_dir).eval()) < 1e-5

    capsys.readouterr()
    assert run_convert(parser.parse_args(["convert", "meshlm-to-hf", str(hf_dir / "model.safetensors"), "x"])) == 2
    assert "not a meshlm checkpoint file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_attention_heads": "4"}, "num_attention_heads='4' should be a positive integer below 2**63"),
        ({"hidden_size": 64.0}, "hidden_size=64.0 should be a positive integer"),
        ({"vocab_size": True}, "vocab_size=True should be a positive integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0 should be a positive integer"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' should be a positive finite number"),
        ({"rope_theta": float("nan")}, "rope_theta=nan should be a positive finite number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_parameters.rope_theta=-1 should be"),
        ({"rope_scaling": 3}, "rope_scaling=3 should be an object or null"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' should be true or false"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
        ({"hidden_size": 66, "head_dim": None}, "hidden_size (66) must be divisible by num_attention_heads (4)"),
        ({"hidden_size": 12, "head_dim": None}, "hidden_size / num_attention_heads = 3 must be even"),
        ({"vocab_size": 2**62}, "vocab_size × hidden_size = 295147905179352825856 elements: too large"),
        ({"vocab_size": "x" * 100}, "vocab_size='" + "x" * 36 + "... should be"),
    ],
)
def test_wrong_types_and_ranges_name_the_field(changes: dict, message: str) -> None:
    hf_config = hf_config_from_model(make_meshlm_model().cfg) | changes
    with pytest.raises(ValueError) as info:
        model_config_from_hf(hf_config)
    assert str(info.value).startswith("config.json: ")
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_invalid_json_names_the_file(hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text('{"vocab_size": 128,')
    with pytest.raises(ValueError, match=r"hf/config\.json: invalid JSON \(Expecting property name"):
        import_hf(hf_dir)
    (hf_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"hf: config\.json: should be a JSON object of fields, got list"):
        import_hf(hf_dir)


def test_a_depth_the_weights_lack_is_refused_before_building(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text()) | {"num_hidden_layers": 10**12}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config\.json: num_hidden_layers=1000000000000 but .*model\.safetensors holds 2"
    ):
        import_hf(hf_dir)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="meshlm")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    capsys.readouterr()
    code = run_convert(parser.parse_args(["convert", *args]))
    return code, capsys.readouterr().err


def test_truncated_safetensors_is_one_line_in_both_directions(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meshlm_file = tmp_path / "ckpt.safetensors"
    assert run_cli(["hf-to-meshlm", str(hf_dir), str(meshlm_file)], capsys)[0] == 0
    for path, args in [
        (hf_dir / "model.safetensors", ["hf-to-meshlm", str(hf_dir), str(tmp_path / "x.safetensors")]),
        (meshlm_file, ["meshlm-to-hf", str(meshlm_file), str(tmp_path / "out")]),
    ]:
        data = path.read_bytes()
        for cut in (len(data) // 2, 5):
            path.write_bytes(data[:cut])
            code, err = run_cli(args, capsys)
            assert code == 2 and len(err.splitlines()) == 1, err
            assert f"{path}: not a valid safetensors file (Error while deserializing header" in err


def test_index_problems_name_the_file(tmp_path: Path) -> None:
    export_hf(make_meshlm_model(), tmp_path, max_shard_bytes=30_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first_shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{first_shard}: shard listed in .*index\.json does not exist"):
        import_hf(tmp_path)
    index_path.write_text("{")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: invalid JSON"):
        import_hf(tmp_path)
    index_path.write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    with pytest.raises(ValueError, match=r"index\.json: no weight_map object of tensor name -> file name"):
        import_hf(tmp_path)


def test_meshlm_file_with_bad_metadata_or_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_meshlm_model(tie_embeddings=True)
    path = tmp_path / "ckpt.safetensors"
    for metadata, message in [
        ("{", "metadata meshlm_model_config is not JSON"),
        (json.dumps(model.cfg.to_dict() | {"dim": "wide"}), "meshlm_model_config: model.dim: Input"),
        (json.dumps(model.cfg.to_dict() | {"n_layers": 3}), "missing tensor model.layers.2.input_layernorm"),
    ]:
        tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
        save_file(tensors, path, metadata={"format": "pt", "meshlm_model_config": metadata})
        code, err = run_cli(["meshlm-to-hf", str(path), str(tmp_path / "out")], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
