"""Hugging Face `LlamaForCausalLM` checkpoints in and out of meshlm.

meshlm parameter names and the rotary layout already match HF Llama, so conversion is a matter of
translating `config.json`, checking every tensor's name and shape, and reading/writing safetensors
(never pickle). Only the features meshlm implements are accepted: anything else in `config.json`
(RoPE scaling, biases, another activation, a custom head_dim) is refused rather than silently
producing a different model. transformers is not needed here; it is only used by the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

from meshlm.model.config import ModelConfig
from meshlm.model.llama import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Metadata key of the single-file meshlm checkpoint written by `meshlm convert hf-to-meshlm`.
MESHLM_CONFIG_KEY = "meshlm_model_config"

_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """Translate a Llama `config.json` dict, refusing features meshlm's model does not implement."""

    def unsupported(field: str, value: object, wanted: str) -> ValueError:
        return ValueError(f"config.json: {field}={value!r} is not supported by meshlm (needs {wanted})")

    for field in _REQUIRED_FIELDS:
        if field not in hf_config:
            raise ValueError(f"config.json: missing required field {field}")
    if hf_config.get("model_type", "llama") != "llama":
        raise unsupported("model_type", hf_config["model_type"], "'llama'")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", hf_config["hidden_act"], "'silu'")
    for field in ("attention_bias", "mlp_bias"):
        if hf_config.get(field, False):
            raise unsupported(field, hf_config[field], "false")
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise unsupported("head_dim", head_dim, "hidden_size / num_attention_heads")
    # transformers 4 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    rope_theta = hf_config.get("rope_theta", 10000.0)
    for field in ("rope_scaling", "rope_parameters"):
        rope = hf_config.get(field) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise unsupported(f"{field}.rope_type", rope_type, "'default'")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported(f"{field}.partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
        rope_theta = rope.get("rope_theta", rope_theta)
    if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
        raise unsupported("partial_rotary_factor", hf_config["partial_rotary_factor"], "1.0")
    try:
        return ModelConfig(
            vocab_size=hf_config["vocab_size"],
            dim=dim,
            n_layers=hf_config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
            intermediate_size=hf_config["intermediate_size"],
            max_seq_len=hf_config.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta),
            norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf_config.get("tie_word_embeddings", False),
            init_std=hf_config.get("initializer_range", 0.02),
        )
    except ValueError as e:
        raise ValueError(f"config.json: shape meshlm cannot build: {e}") from e


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `config.json` dict that both transformers 4 (`rope_theta`, `torch_dtype`) and 5
    (`rope_parameters`; reads `torch_dtype` too) turn into the same `LlamaConfig`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every meshlm tensor, read off a meta-device model so it follows llama.py."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_shapes(
    found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: Callable[[str], str]
) -> None:
    """Raise on the first missing, unexpected or mis-shaped tensor; `where(name)` names its file."""
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{where(name)}: missing tensor {name}")
        if found[name] != shape:
            raise ValueError(f"{where(name)}: tensor {name} has shape {list(found[name])}, expected {list(shape)}")
    for name in sorted(found.keys() - expected.keys()):
        raise ValueError(f"{where(name)}: unexpected tensor {name}")


def _tensor_files(directory: Path) -> tuple[dict[str, Path], Path]:
    """Map each stored tensor name to its safetensors file; also return the file listing them."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single), single
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        return {name: directory / file for name, file in weight_map.items()}, index
    raise FileNotFoundError(
        f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)"
    )


def import_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF Llama checkpoint directory into a meshlm config and a state dict with the keys of
    `Transformer(cfg).state_dict()` (tensors keep their stored dtype). Checks names and shapes from
    the safetensors headers before loading any data."""
    directory = Path(directory)
    try:
        cfg = model_config_from_hf(json.loads((directory / CONFIG_NAME).read_text()))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from e

    expected = _expected_shapes(cfg)
    if cfg.tie_embeddings:  # HF stores a tied head once, as the embedding
        del expected["lm_head.weight"]
    files, listing = _tensor_files(directory)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not name.endswith("rotary_emb.inv_freq"):  # a buffer some old exports saved
            by_file.setdefault(path, []).append(name)

    shapes: dict[str, tuple[int, ...]] = {}
    for path, names in by_file.items():
        if not path.exists():
            raise FileNotFoundError(f"{path}: shard listed in {listing} does not exist")
        with safe_open(path, framework="pt") as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    raise ValueError(f"{path}: missing tensor {name} (listed in {listing})")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    _check_shapes(shapes, expected, lambda name: str(files.get(name, listing)))

    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in names})
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return cfg, state


def load_hf_into_model(directory: str | Path) -> Transformer:
    """Build a (float32) meshlm model holding an HF Llama checkpoint's weights."""
    cfg, state = import_hf(directory)
    model = Transformer(cfg)
    model.load_state_dict(state)
    return model


def export_hf(
    model: Transformer,
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `model` as an HF Llama checkpoint directory that `LlamaForCausalLM.from_pretrained` loads.

    Tensors go to `model.safetensors`, or to `model-0000i-of-0000n.safetensors` plus an index when
    they exceed `max_shard_bytes`; weights files from an earlier export to `directory` are removed
    so they cannot be mixed with the new ones. `model` must be a whole single-device model, not a
    pipeline stage or tensor-parallel shard."""
    cfg = model.cfg
    state = model.state_dict()
    _check_shapes(
        {n: tuple(t.shape) for n, t in state.items()},
        _expected_shapes(cfg),
        lambda _: "export_hf (needs the whole, unsharded model)",
    )
    if cfg.tie_embeddings:
        del state["lm_head.weight"]
    tensors = {name: state[name].detach().to("cpu", dtype).contiguous() for name in sorted(state)}

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [directory / WEIGHTS_NAME, directory / INDEX_NAME, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config_from_model(cfg, dtype), indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], directory / WEIGHTS_NAME, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _save_meshlm_file(model: Transformer, path: Path) -> None:
    """Interim meshlm checkpoint: one safetensors file, the model config as JSON in its metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path), metadata={"format": "pt", MESHLM_CONFIG_KEY: json.dumps(model.cfg.to_dict())})


def _load_meshlm_file(path: Path) -> Transformer:
    """A meshlm safetensors file, a training checkpoint folder, or a run directory (its newest checkpoint)."""
    if path.is_dir():
        from meshlm.checkpoint import latest_valid_checkpoint, load_model_state, read_trainer_state

        checkpoint = path if (path / "trainer.json").is_file() else latest_valid_checkpoint(path)
        if checkpoint is None:
            raise ValueError(f"{path}: neither a checkpoint folder nor a run directory with a valid checkpoint")
        model = Transformer(ModelConfig(**read_trainer_state(checkpoint)["model"]))
        model.load_state_dict(load_model_state(checkpoint))
        return model
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    if MESHLM_CONFIG_KEY not in metadata:
        raise ValueError(f"{path}: no {MESHLM_CONFIG_KEY} metadata; not a meshlm checkpoint file")
    model = Transformer(ModelConfig(**json.loads(metadata[MESHLM_CONFIG_KEY])))
    load_model(model, path, strict=True)
    return model


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `meshlm convert {hf-to-meshlm,meshlm-to-hf}`; dispatch the parsed args to `run_convert`."""
    parser = subparsers.add_parser("convert", help="convert checkpoints between meshlm and Hugging Face Llama")
    modes = parser.add_subparsers(dest="convert_mode", required=True)
    to_meshlm = modes.add_parser("hf-to-meshlm", help="HF Llama directory -> meshlm safetensors file")
    to_meshlm.add_argument("src", type=Path, metavar="SRC_HF_DIR")
    to_meshlm.add_argument("out", type=Path, metavar="OUT_FILE")
    to_hf = modes.add_parser(
        "meshlm-to-hf", help="meshlm safetensors file, checkpoint folder or run directory -> HF Llama directory"
    )
    to_hf.add_argument("src", type=Path, metavar="SRC")
    to_hf.add_argument("out", type=Path, metavar="OUT_HF_DIR")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    to_hf.add_argument("--max-shard-bytes", type=int, default=None, help="split weights into shards this size")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Run a parsed `meshlm convert` command; bad input gives a one-line error and exit code 1."""
    try:
        if args.convert_mode == "hf-to-meshlm":
            _save_meshlm_file(load_hf_into_model(args.src), args.out)
        else:
            export_hf(_load_meshlm_file(args.src), args.out, getattr(torch, args.dtype), args.max_shard_bytes)
    except (ValueError, OSError) as e:
        print(f"meshlm convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0
