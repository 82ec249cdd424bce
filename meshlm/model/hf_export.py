"""meshlm's model as a Hugging Face checkpoint directory (config.json + safetensors) of its family, and the
interim one-file meshlm checkpoint `meshlm convert hf-to-meshlm` writes; the reading side, the name and shape
checks both use, is meshlm.model.hf."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file, save_model

from meshlm.files import atomic_write
from meshlm.model.config import ModelConfig
from meshlm.model.hf import (
    CONFIG_NAME,
    FAMILIES,
    INDEX_NAME,
    MESHLM_CONFIG_KEY,
    WEIGHTS_NAME,
    _check_shapes,
    _expected_shapes,
    hf_tensor_names,
)
from meshlm.model.llama import Transformer
from meshlm.ties import unique_state_names


def _check_moe_export(cfg: ModelConfig) -> None:
    """Refuse, in one line, an MoE model its family's transformers class cannot hold exactly."""
    family = cfg.hf_model_type
    wants = {"moe_score": "softmax"}
    if family == "mixtral":
        wants |= {"norm_topk": True, "shared_expert_intermediate_size": 0, "first_k_dense": 0, "moe_layer_step": 1}
    elif family == "qwen2_moe":
        wants["shared_expert_gate"] = True
    elif family == "qwen3_moe":
        wants["shared_expert_intermediate_size"] = 0
    for name, value in wants.items():
        if getattr(cfg, name) != value:
            raise ValueError(
                f"model.{name}={getattr(cfg, name)!r} cannot be exported as {FAMILIES[family]} (it needs {value!r})"
            )
    if family == "mixtral" and cfg.moe_intermediate_size != cfg.intermediate_size:
        raise ValueError(
            f"model.moe_intermediate_size ({cfg.moe_intermediate_size}) must equal model.intermediate_size "
            f"({cfg.intermediate_size}) to export as MixtralForCausalLM (its experts are intermediate_size wide)"
        )


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `config.json` dict that both transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5
    (`rope_parameters`; reads `torch_dtype` too) turn into the same config of the model's family."""
    scaling: dict[str, object] = {}
    if cfg.llama3_rope is not None:
        factor, low, high, original = cfg.llama3_rope
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    if cfg.n_experts:
        _check_moe_export(cfg)
    moe = {
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk,
        "decoder_sparse_step": cfg.moe_layer_step,
        "mlp_only_layers": list(range(cfg.first_k_dense)),
        "router_aux_loss_coef": cfg.aux_loss_coef,
    }
    family: dict[str, object] = {
        "llama": {"attention_bias": False, "mlp_bias": False},
        "qwen2": {"use_sliding_window": False, "sliding_window": None},
        "mistral": {"sliding_window": cfg.sliding_window or None},  # written even when null: absent means 4096
        "mixtral": {
            "sliding_window": cfg.sliding_window or None,
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k,
            "router_aux_loss_coef": cfg.aux_loss_coef,
            "router_jitter_noise": 0.0,
        },
        "qwen2_moe": {
            "use_sliding_window": False,
            "sliding_window": None,
            **moe,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        },
        "qwen3_moe": {"use_sliding_window": False, "sliding_window": None, "attention_bias": False, **moe},
    }[cfg.hf_model_type]
    return {
        "architectures": [FAMILIES[cfg.hf_model_type]],
        "model_type": cfg.hf_model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta} | scaling,
        **({"rope_scaling": scaling} if scaling else {}),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        **family,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(
    model: Transformer,
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `model` as an HF checkpoint directory that its family's class (`LlamaForCausalLM`,
    `Qwen2ForCausalLM` or `MistralForCausalLM`, by `model.cfg.hf_model_type`) or `AutoModelForCausalLM` loads.

    Tensors go to `model.safetensors`, or to `model-0000i-of-0000n.safetensors` plus an index when
    they exceed `max_shard_bytes`; weights files from an earlier export to `directory` are removed
    so they cannot be mixed with the new ones. `model` must be a whole single-device model, not a
    pipeline stage or tensor-parallel shard."""
    cfg = model.cfg
    full = model.state_dict()
    state = {name: full[name] for name in unique_state_names(model)}  # a tied head once, as HF stores it
    _check_shapes(
        {n: tuple(t.shape) for n, t in state.items()},
        _expected_shapes(cfg),
        lambda _: "export_hf (needs the whole, unsharded model)",
    )
    if cfg.n_experts:
        _check_moe_export(cfg)
    stored = {}
    for name, tensor in state.items():
        parts = hf_tensor_names(cfg, name)
        stored.update(zip(parts, tensor.unbind(0), strict=True) if len(parts) > 1 else {parts[0]: tensor})
    tensors = {name: stored[name].detach().to("cpu", dtype).contiguous() for name in sorted(stored)}

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
    atomic_write(directory / CONFIG_NAME, json.dumps(hf_config_from_model(cfg, dtype), indent=2) + "\n")
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
    atomic_write(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def _save_meshlm_file(model: Transformer, path: Path) -> None:
    """Interim meshlm checkpoint: one safetensors file, the model config as JSON in its metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path), metadata={"format": "pt", MESHLM_CONFIG_KEY: json.dumps(model.cfg.to_dict())})
