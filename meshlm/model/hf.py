"""Hugging Face Llama, Qwen2, Mistral and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints
into meshlm (out of it: meshlm.model.hf_export).

The three families share Llama's parameter names and rotary layout, which meshlm's model uses too, so
conversion is a matter of translating `config.json`, checking every tensor's name and shape, and
reading/writing safetensors (never pickle). Only the features meshlm implements are accepted (Qwen2's q/k/v
biases, an explicit head_dim, Llama 3.1's `llama3` RoPE scaling, Mistral's window as a recorded limit):
anything else in `config.json` (other RoPE scalings, MLP or output-projection biases, another activation,
attention that differs from full causal attention within max_position_embeddings) is refused rather than
silently producing a different model. transformers is not needed here; it is only used by the tests.

The MoE families store each expert as its own tensors (`mlp.experts.3.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.3.w1.weight`), meshlm stacks them (`mlp.experts.gate_proj`, experts × out × in):
`hf_tensor_names` maps one to the other, and the checks below are on the stored (HF) names.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from meshlm.model.config import ModelConfig
from meshlm.model.llama import Transformer
from meshlm.ties import load_state, tied_aliases, unique_state_names

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Metadata key of the single-file meshlm checkpoint written by `meshlm convert hf-to-meshlm`.
MESHLM_CONFIG_KEY = "meshlm_model_config"

_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# model_type -> the transformers class, and the defaults of its config class for fields a config.json may omit
# (absent and null differ for two of them: a null num_key_value_heads is num_attention_heads, a null
# sliding_window is no window).
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_MAX_POSITIONS = {
    "llama": 2048,
    "qwen2": 32768,
    "mistral": 131072,
    "mixtral": 131072,
    "qwen2_moe": 32768,
    "qwen3_moe": 32768,
}
_KV_HEADS = {"llama": None, "qwen2": 32, "mistral": 8, "mixtral": 8, "qwen2_moe": 16, "qwen3_moe": 4}
_ROPE_THETA = {"mixtral": 1e6}  # the config classes' defaults, 10000 for the others
_NORM_EPS = {"mixtral": 1e-5}  # 1e-6 for the others
# MoE config classes' defaults: (n_experts, top_k, moe_intermediate_size); Mixtral's expert width is intermediate_size
_MOE_DEFAULTS = {"mixtral": (8, 2, None), "qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}
_MIXTRAL_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SLIDING_WINDOW = 4096  # Qwen2Config and MistralConfig
_QWEN2_MAX_WINDOW_LAYERS = 28


def _short(value: object) -> str:
    """repr of a config value, cut to 40 characters so a huge one still gives a readable line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _error_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise ValueError(f"config.json: {field}={_short(value)} should be a positive integer below 2**63")
    return value


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= sys.float_info.max:
        raise ValueError(f"config.json: {field}={_short(value)} should be a positive finite number")
    return float(value)


def _unsupported(field: str, value: object, wanted: str) -> ValueError:
    return ValueError(f"config.json: {field}={_short(value)} is not supported by meshlm (needs {wanted})")


def _rope_fields(hf_config: dict, max_seq_len: int, default_theta: float = 10000.0) -> dict[str, object]:
    """rope_theta, rope_type and the llama3 scaling of a config.json, as ModelConfig fields. Like transformers,
    a non-empty rope_scaling (transformers 4's field) is read in preference to rope_parameters (transformers 5),
    and a rope_theta inside it in preference to the top-level one."""
    top_theta = hf_config.get("rope_theta")
    rope_theta = _number("rope_theta", default_theta if top_theta is None else top_theta)
    for field in ("rope_scaling", "rope_parameters"):
        if hf_config.get(field) is not None and not isinstance(hf_config[field], dict):
            raise ValueError(f"config.json: {field}={_short(hf_config[field])} should be an object or null")
    field = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
    rope = hf_config.get(field) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise _unsupported(f"{field}.rope_type", rope_type, "'default' or 'llama3'")
    for where, value in (
        (f"{field}.partial_rotary_factor", rope.get("partial_rotary_factor")),
        ("partial_rotary_factor", hf_config.get("partial_rotary_factor")),
    ):
        if value is not None and value != 1.0:
            raise _unsupported(where, value, "1.0")
    if rope.get("rope_theta") is not None:
        rope_theta = _number(f"{field}.rope_theta", rope["rope_theta"])
    if rope_type == "default":
        return {"rope_theta": rope_theta, "rope_type": rope_type}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if rope.get(key) is None:
            raise ValueError(f"config.json: {field}.{key} is missing (rope_type 'llama3' needs it)")
    factor = _number(f"{field}.factor", rope["factor"])
    low = _number(f"{field}.low_freq_factor", rope["low_freq_factor"])
    high = _number(f"{field}.high_freq_factor", rope["high_freq_factor"])
    if high <= low:
        raise ValueError(f"config.json: {field}.high_freq_factor ({high}) must exceed {field}.low_freq_factor ({low})")
    original = rope.get("original_max_position_embeddings")  # transformers' default: max_position_embeddings
    return {
        "rope_theta": rope_theta,
        "rope_type": rope_type,
        "rope_factor": factor,
        "rope_low_freq_factor": low,
        "rope_high_freq_factor": high,
        "rope_original_max_seq_len": (
            max_seq_len if original is None else _positive_int(f"{field}.original_max_position_embeddings", original)
        ),
    }


def _check_qwen2_window(hf_config: dict, n_layers: int, max_seq_len: int) -> None:
    """Refuse a Qwen2 with layers that attend a window shorter than max_position_embeddings: with
    use_sliding_window set, the layers from max_window_layers on (or those layer_types names) slide, and
    meshlm runs full attention in every layer."""
    use = hf_config.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ValueError(f"config.json: use_sliding_window={_short(use)} should be true or false")
    window = hf_config.get("sliding_window", _SLIDING_WINDOW)
    if not use or window is None:
        return
    window = _positive_int("sliding_window", window)
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        first = hf_config.get("max_window_layers")
        first = _QWEN2_MAX_WINDOW_LAYERS if first is None else first
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config.json: max_window_layers={_short(first)} should be a non-negative integer")
        sliding = max(n_layers - first, 0)
    else:
        kinds = ("full_attention", "sliding_attention")
        if not (
            isinstance(layer_types, list) and len(layer_types) == n_layers and all(t in kinds for t in layer_types)
        ):
            raise ValueError(
                f"config.json: layer_types={_short(layer_types)} should list num_hidden_layers ({n_layers}) "
                f"of {' / '.join(kinds)}"
            )
        sliding = layer_types.count("sliding_attention")
    if sliding and window < max_seq_len:
        raise _unsupported(
            "use_sliding_window",
            use,
            f"false, or sliding_window ({window}) >= max_position_embeddings ({max_seq_len}); {sliding} of "
            f"{n_layers} layers would attend a window, meshlm runs full attention",
        )


def _get(hf_config: dict, field: str, default: object = None) -> object:
    """A config.json field; a null counts as absent."""
    value = hf_config.get(field)
    return default if value is None else value


def _integer(hf_config: dict, field: str, default: int | None = None) -> int:
    return _positive_int(field, _get(hf_config, field, default))


def _model_type(hf_config: dict) -> str:
    """The family, once every field meshlm's model needs is present and no feature it lacks is asked for."""
    model_type = _get(hf_config, "model_type", "llama")  # first: another family's fields are named differently
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise _unsupported("model_type", model_type, " or ".join(repr(f) for f in FAMILIES))
    for field in _REQUIRED_FIELDS:
        if _get(hf_config, field) is None:
            raise ValueError(f"config.json: missing required field {field}")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf_config["hidden_act"], "'silu'")
    for field in ("attention_bias", "mlp_bias"):
        if _get(hf_config, field, False) is not False:
            raise _unsupported(field, hf_config[field], "false; q/k/v-only biases are model_type 'qwen2'")
    if model_type == "qwen2_moe" and _get(hf_config, "qkv_bias", True) is not True:
        raise _unsupported("qkv_bias", hf_config["qkv_bias"], "true (Qwen2-MoE's q/k/v biases)")
    return model_type


def _attention_shape(hf_config: dict, model_type: str) -> tuple[int, int, int, int]:
    """hidden_size, attention heads, key/value heads and head_dim, checked against each other."""
    dim, n_heads = _integer(hf_config, "hidden_size"), _integer(hf_config, "num_attention_heads")
    kv_heads = hf_config.get("num_key_value_heads", _KV_HEADS[model_type])  # a null: as many as heads
    n_kv_heads = n_heads if kv_heads is None else _positive_int("num_key_value_heads", kv_heads)
    if dim % n_heads:
        raise ValueError(f"config.json: hidden_size ({dim}) must be divisible by num_attention_heads ({n_heads})")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads ({n_heads}) must be divisible by num_key_value_heads ({n_kv_heads})"
        )
    head_dim = _integer(hf_config, "head_dim", dim // n_heads)
    if head_dim % 2:
        field = "head_dim" if _get(hf_config, "head_dim") is not None else "hidden_size / num_attention_heads"
        raise ValueError(f"config.json: {field} = {head_dim} must be even (rotary embeddings)")
    return dim, n_heads, n_kv_heads, head_dim


def _sliding_window(hf_config: dict, model_type: str, n_layers: int, max_seq_len: int) -> int:
    """Mistral's window (a recorded limit; 0: none); Qwen's must not change attention within the model."""
    if model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
        _check_qwen2_window(hf_config, n_layers, max_seq_len)
    if model_type not in ("mistral", "mixtral"):
        return 0
    window = hf_config.get("sliding_window", _SLIDING_WINDOW)  # a null: no window
    return 0 if window is None else _positive_int("sliding_window", window)


def _check_tensor_sizes(largest: dict[str, int]) -> None:
    """Refuse a config whose largest weight or rotary table (product -> elements) cannot be one fp32 tensor."""
    for product, numel in largest.items():
        if numel * 4 >= 2**63:
            raise ValueError(f"config.json: {product} = {numel} elements: too large for one fp32 tensor")


def model_config_from_hf(hf_config: object) -> ModelConfig:
    """Translate a Llama, Qwen2 or Mistral `config.json` object, refusing features meshlm's model does not
    implement and values of the wrong type or range, each with one line naming the field. A null counts as
    absent, except where transformers reads it differently (num_key_value_heads, sliding_window)."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"config.json: should be a JSON object of fields, got {type(hf_config).__name__}")
    model_type = _model_type(hf_config)
    dim, n_heads, n_kv_heads, head_dim = _attention_shape(hf_config, model_type)
    tie = _get(hf_config, "tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"config.json: tie_word_embeddings={_short(tie)} should be true or false")
    vocab_size, intermediate_size = _integer(hf_config, "vocab_size"), _integer(hf_config, "intermediate_size")
    n_layers = _integer(hf_config, "num_hidden_layers")
    max_seq_len = _integer(hf_config, "max_position_embeddings", _MAX_POSITIONS[model_type])
    rope = _rope_fields(hf_config, max_seq_len, _ROPE_THETA.get(model_type, 10000.0))
    sliding_window = _sliding_window(hf_config, model_type, n_layers, max_seq_len)
    moe = _moe_fields(hf_config, model_type, n_layers, intermediate_size) if model_type in _MOE_DEFAULTS else {}
    _check_tensor_sizes({  # every weight and rotary table of llama.py is at most one of these
        "vocab_size × hidden_size": vocab_size * dim,
        "intermediate_size × hidden_size": intermediate_size * dim,
        "num_attention_heads × head_dim × hidden_size": n_heads * head_dim * dim,
        "max_position_embeddings × head_dim": max_seq_len * head_dim,
        "num_experts × moe_intermediate_size × hidden_size": moe.get("n_experts", 0)
        * moe.get("moe_intermediate_size", 0) * dim,
    })  # fmt: skip
    return ModelConfig(
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        intermediate_size=intermediate_size,
        max_seq_len=max_seq_len,
        norm_eps=_number("rms_norm_eps", _get(hf_config, "rms_norm_eps", _NORM_EPS.get(model_type, 1e-6))),
        tie_embeddings=tie,
        init_std=_number("initializer_range", _get(hf_config, "initializer_range", 0.02)),
        head_dim_override=0 if head_dim == dim // n_heads else head_dim,
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        sliding_window=sliding_window,
        hf_model_type=model_type,
        qk_norm=model_type == "qwen3_moe",
        **rope,
        **moe,
    )


def _moe_fields(hf_config: dict, model_type: str, n_layers: int, intermediate_size: int) -> dict[str, object]:
    """The MoE ModelConfig fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json. Which layers are sparse
    (Qwen's mlp_only_layers and decoder_sparse_step) must be expressible as meshlm's first_k_dense and
    moe_layer_step; a router that differs from meshlm's in training (jitter noise) is refused."""
    experts_default, top_k_default, width_default = _MOE_DEFAULTS[model_type]
    key = "num_local_experts" if model_type == "mixtral" or "num_local_experts" in hf_config else "num_experts"
    value = hf_config.get(key)
    n_experts = _positive_int(key, experts_default if value is None else value)
    value = hf_config.get("num_experts_per_tok")
    top_k = _positive_int("num_experts_per_tok", top_k_default if value is None else value)
    if top_k > n_experts:
        raise ValueError(f"config.json: num_experts_per_tok ({top_k}) exceeds {key} ({n_experts})")
    jitter = hf_config.get("router_jitter_noise")
    if jitter:
        raise _unsupported("router_jitter_noise", jitter, "0")
    coef = hf_config.get("router_aux_loss_coef")
    aux = 0.001 if coef is None else coef
    if isinstance(aux, bool) or not isinstance(aux, int | float) or not 0 <= aux < float("inf"):
        raise ValueError(f"config.json: router_aux_loss_coef={_short(coef)} should be a finite number >= 0")
    fields: dict[str, object] = {"n_experts": n_experts, "top_k": top_k, "aux_loss_coef": float(aux)}
    if model_type == "mixtral":
        return fields | {"moe_intermediate_size": intermediate_size, "norm_topk": True}
    value = hf_config.get("moe_intermediate_size")
    fields["moe_intermediate_size"] = _positive_int("moe_intermediate_size", width_default if value is None else value)
    norm = hf_config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"config.json: norm_topk_prob={_short(norm)} should be true or false")
    fields["norm_topk"] = norm
    if model_type == "qwen2_moe":
        value = hf_config.get("shared_expert_intermediate_size")
        shared = _positive_int("shared_expert_intermediate_size", 5632 if value is None else value)
        fields |= {"shared_expert_intermediate_size": shared, "shared_expert_gate": True}
    value = hf_config.get("decoder_sparse_step")
    step = _positive_int("decoder_sparse_step", 1 if value is None else value)
    dense = hf_config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers={_short(dense)} should be a list of layer indices")
    sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    first = sparse[0] if sparse else n_layers
    if not sparse or sparse != [i for i in range(first, n_layers) if (i + 1) % step == 0]:
        raise _unsupported(
            "mlp_only_layers",
            dense,
            f"the first k layers only, leaving at least one MoE layer (decoder_sparse_step {step})",
        )
    return fields | {"first_k_dense": first, "moe_layer_step": step}


def hf_tensor_names(cfg: ModelConfig, name: str) -> tuple[str, ...]:
    """The stored tensor name(s) of meshlm parameter `name`: itself, except in an MoE layer, where a stacked
    expert weight is one HF tensor per expert (in expert order) and Mixtral's feed-forward is `block_sparse_moe`."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(.+)", name)
    if m is None or int(m[1]) not in cfg.moe_layers:
        return (name,)
    mixtral = cfg.hf_model_type == "mixtral"
    prefix = f"model.layers.{m[1]}.{'block_sparse_moe' if mixtral else 'mlp'}."
    expert = re.fullmatch(r"experts\.(gate_proj|up_proj|down_proj)", m[2])
    if expert is None:
        return (prefix + m[2],)
    part = _MIXTRAL_EXPERT_PARTS[expert[1]] if mixtral else expert[1]
    return tuple(f"{prefix}experts.{e}.{part}.weight" for e in range(cfg.n_experts))


def _hf_expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape of every tensor of an HF checkpoint of `cfg` (each expert's weight on its own)."""
    expected: dict[str, tuple[int, ...]] = {}
    for name, shape in _expected_shapes(cfg).items():
        stored = hf_tensor_names(cfg, name)
        expected.update(dict.fromkeys(stored, shape[1:] if len(stored) > 1 else shape))
    return expected


@functools.lru_cache(maxsize=8)
def _model_names(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape of every tensor a checkpoint of meshlm's model stores, a tied weight once under its
    canonical name; tie alias -> canonical name), read off one meta-device model so they follow llama.py."""
    with torch.device("meta"):
        model = Transformer(cfg)
    state = model.state_dict()
    return {name: tuple(state[name].shape) for name in unique_state_names(model)}, tied_aliases(model)


def tied_names(cfg: ModelConfig) -> dict[str, str]:
    """Each alias of a tied weight of meshlm's model -> the name checkpoints store it under (meshlm.ties):
    `lm_head.weight` -> `model.embed_tokens.weight` when `tie_embeddings`, as HF stores it too."""
    return dict(_model_names(cfg)[1])


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return dict(_model_names(cfg)[0])


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


def _read_json(path: Path) -> object:
    """A JSON file's value; invalid JSON (or text that is not UTF-8) is one line naming the file."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: invalid JSON ({_error_line(e)})") from None


@contextlib.contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open`, with a truncated or corrupt file (header or data) reported in one line naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path}: not a valid safetensors file ({_error_line(e)})") from None


def _tensor_files(directory: Path) -> tuple[dict[str, Path], Path]:
    """Map each stored tensor name to its safetensors file; also return the file listing them."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.exists():
        with _open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single), single
    if index.exists():
        listing = _read_json(index)
        weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
            raise ValueError(f"{index}: no weight_map object of tensor name -> file name")
        return {name: directory / file for name, file in weight_map.items()}, index
    raise FileNotFoundError(
        f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)"
    )


def read_hf_config(directory: str | Path) -> ModelConfig:
    """The meshlm config of an HF checkpoint directory's `config.json`; errors name the directory."""
    directory = Path(directory)
    hf_config = _read_json(directory / CONFIG_NAME)
    try:
        return model_config_from_hf(hf_config)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None


def check_hf_checkpoint(
    directory: str | Path, cfg: ModelConfig | None = None
) -> tuple[ModelConfig, dict[Path, list[str]]]:
    """An HF checkpoint directory's meshlm config (`cfg` if the caller has read it: `read_hf_config`), and each
    safetensors file with the tensors it holds, after checking every name and shape against the config from the
    headers alone (no tensor data is read)."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    cfg = cfg or read_hf_config(directory)
    files, listing = _tensor_files(directory)
    stored_layers = {int(m[1]) for name in files if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if len(stored_layers) != cfg.n_layers:  # checked first: a huge claimed depth would take long to build
        raise ValueError(f"{config_path}: num_hidden_layers={cfg.n_layers} but {listing} holds {len(stored_layers)}")
    expected = _hf_expected_shapes(cfg)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not name.endswith("rotary_emb.inv_freq"):  # a buffer some old exports saved
            by_file.setdefault(path, []).append(name)

    shapes: dict[str, tuple[int, ...]] = {}
    for path, names in by_file.items():
        if not path.exists():
            raise FileNotFoundError(f"{path}: shard listed in {listing} does not exist")
        with _open_safetensors(path) as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    raise ValueError(f"{path}: missing tensor {name} (listed in {listing})")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    _check_shapes(shapes, expected, lambda name: str(files.get(name, listing)))
    return cfg, by_file


def import_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF Llama / Qwen2 / Mistral checkpoint directory into a meshlm config and a state dict with the keys of
    `Transformer(cfg).state_dict()` (tensors keep their stored dtype). Checks names and shapes from
    the safetensors headers before loading any data."""
    cfg, by_file = check_hf_checkpoint(directory)
    stored: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open_safetensors(path) as f:
            stored.update({name: f.get_tensor(name) for name in names})
    state = {}
    for name in _expected_shapes(cfg):  # canonical names: a tied head is stored once, as the embedding
        parts = hf_tensor_names(cfg, name)
        state[name] = torch.stack([stored.pop(p) for p in parts]) if len(parts) > 1 else stored[parts[0]]
    state.update({alias: state[name] for alias, name in tied_names(cfg).items()})
    return cfg, state


def load_hf_into_model(directory: str | Path) -> Transformer:
    """Build a (float32) meshlm model holding an HF checkpoint's weights."""
    cfg, state = import_hf(directory)
    model = Transformer(cfg)
    load_state(model, state, str(directory))
    return model
