"""Model shapes: a validated dataclass plus named presets from `tiny` to Llama-3 405B."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

HfModelType = Literal["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"]
HF_MODEL_TYPES = get_args(HfModelType)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MoeScore = Literal["softmax", "sigmoid"]
MOE_SCORES = get_args(MoeScore)
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
# Fields added after checkpoints recorded ModelConfig: one that lacks them holds a plain Llama (the defaults).
MOE_FIELDS = (
    "n_experts",
    "top_k",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_expert_gate",
    "moe_score",
    "norm_topk",
    "first_k_dense",
    "moe_layer_step",
    "aux_loss_coef",
    "z_loss_coef",
)
FAMILY_FIELDS = (
    "head_dim_override",
    "qkv_bias",
    "rope_type",
    *LLAMA3_ROPE_FIELDS,
    "sliding_window",
    "hf_model_type",
    "qk_norm",
    *MOE_FIELDS,
)


def option(default: Any, description: str | None = None, **constraints: float) -> Any:
    """A ModelConfig field with its meaning and bounds, declared once: the run config's `[model]` section
    (meshlm.config.ModelSection) is generated from these, so `--help` and `meshlm config reference` print them
    and validate the bounds (`gt`, `ge`) with one-line errors."""
    return dataclasses.field(default=default, metadata={"description": description, **constraints})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder. Field names follow the usual Llama vocabulary."""

    vocab_size: int = option(2048, gt=0)
    dim: int = option(256, gt=0)
    n_layers: int = option(4, gt=0)
    n_heads: int = option(8, gt=0)
    n_kv_heads: int = option(4, gt=0)
    intermediate_size: int = option(688, gt=0)
    max_seq_len: int = option(256, gt=0)
    rope_theta: float = option(10000.0, gt=0)
    norm_eps: float = option(1e-5, gt=0)
    tie_embeddings: bool = option(False)
    init_std: float = option(0.02, gt=0)
    # Hugging Face families beyond plain Llama. The defaults are plain Llama, so a model without these
    # fields (a checkpoint written before they existed) is the same model; 0 means unset.
    head_dim_override: int = option(0, "width of one attention head; 0 = dim / n_heads", ge=0)
    qkv_bias: bool = option(False, "biases on the q/k/v projections (Qwen2; needs hf_model_type qwen2)")
    rope_type: Literal["default", "llama3"] = option(
        "default", "'default', or 'llama3': Llama 3.1+ RoPE frequency scaling by the four rope_* fields"
    )
    rope_factor: float = option(0.0, "llama3 RoPE: factor (the rope_* fields are 0 otherwise)", ge=0)
    rope_low_freq_factor: float = option(0.0, "llama3 RoPE: low_freq_factor", ge=0)
    rope_high_freq_factor: float = option(0.0, "llama3 RoPE: high_freq_factor", ge=0)
    rope_original_max_seq_len: int = option(0, "llama3 RoPE: original_max_position_embeddings", ge=0)
    # meshlm runs full causal attention, which is the same function for sequences of at most this many tokens.
    sliding_window: int = option(0, "Mistral attention window, 0 = none; data.seq_len may not exceed it", ge=0)
    hf_model_type: HfModelType = option(
        "llama",
        "Hugging Face family that export writes: llama (default), qwen2, mistral; with experts "
        "mixtral, qwen2_moe or qwen3_moe",
    )
    qk_norm: bool = option(False, "RMSNorm on each q and k head (Qwen3; needs hf_model_type qwen3_moe)")
    # Mixture of experts (meshlm.model.moe); n_experts = 0 is a dense model and the other fields stay unset.
    n_experts: int = option(0, "routed experts per MoE layer; 0 = a dense model (docs/moe.md)", ge=0)
    top_k: int = option(0, "experts each token is routed to (1..n_experts)", ge=0)
    moe_intermediate_size: int = option(0, "width of one routed expert's SwiGLU", ge=0)
    shared_expert_intermediate_size: int = option(
        0, "width of the shared expert every token passes through; 0 = none", ge=0
    )
    shared_expert_gate: bool = option(False, "scale the shared expert by sigmoid(x·w) (Qwen2-MoE)")
    moe_score: MoeScore = option("softmax", "router scores: softmax or sigmoid")
    norm_topk: bool = option(False, "renormalise each token's top-k scores to sum to 1")
    first_k_dense: int = option(0, "the first k layers keep a dense MLP", ge=0)
    moe_layer_step: int = option(
        1, "after those, layer i is MoE when (i + 1) % step == 0 (Qwen's decoder_sparse_step)", gt=0
    )
    aux_loss_coef: float = option(0.0, "load-balancing loss coefficient, per MoE layer", ge=0)
    z_loss_coef: float = option(0.0, "router z-loss coefficient, per MoE layer", ge=0)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        for name in ("head_dim_override", "sliding_window", *LLAMA3_ROPE_FIELDS):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0 (0: unset), got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            source = "model.head_dim_override" if self.head_dim_override else "model.dim / model.n_heads"
            raise ValueError(f"{source} = {self.head_dim} must be even (rotary embeddings)")
        self._check_rope()
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model.hf_model_type: unknown family {self.hf_model_type!r}; valid: {', '.join(HF_MODEL_TYPES)}"
            )
        # Each family's Hugging Face class fixes its biases and attention, so export stays exact.
        if self.qkv_bias != (self.hf_model_type in ("qwen2", "qwen2_moe")):
            raise ValueError(
                f"model.qkv_bias={self.qkv_bias} does not fit model.hf_model_type {self.hf_model_type!r} "
                "(only qwen2 and qwen2_moe have q/k/v biases, and they always have them)"
            )
        if self.qk_norm != (self.hf_model_type == "qwen3_moe"):
            raise ValueError(
                f"model.qk_norm={self.qk_norm} does not fit model.hf_model_type {self.hf_model_type!r} "
                "(only qwen3_moe has q/k norms, and it always has them)"
            )
        if self.sliding_window and self.hf_model_type not in ("mistral", "mixtral"):
            raise ValueError(
                f"model.sliding_window needs model.hf_model_type 'mistral' or 'mixtral', got {self.hf_model_type!r}"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        """MoE fields: set together and in range. Which of them a Hugging Face family can hold is checked by
        export (meshlm.model.hf), so a router of one's own (sigmoid scores, say) still trains."""
        if self.n_experts < 0:
            raise ValueError(f"model.n_experts must be >= 0 (0: a dense model), got {self.n_experts}")
        is_moe_family = self.hf_model_type in MOE_MODEL_TYPES
        if not self.n_experts:
            if is_moe_family:
                raise ValueError(f"model.hf_model_type {self.hf_model_type!r} needs model.n_experts > 0")
            default = ModelConfig.__dataclass_fields__
            for name in MOE_FIELDS[1:]:
                if getattr(self, name) != default[name].default:
                    raise ValueError(f"model.{name} ({getattr(self, name)!r}) needs model.n_experts > 0")
            return
        if not is_moe_family:
            raise ValueError(
                f"model.n_experts ({self.n_experts}) needs a mixture-of-experts model.hf_model_type "
                f"({', '.join(MOE_MODEL_TYPES)}), got {self.hf_model_type!r}"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k must be between 1 and model.n_experts ({self.n_experts}), got {self.top_k}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"model.moe_intermediate_size must be > 0 with experts, got {self.moe_intermediate_size}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "model.shared_expert_intermediate_size must be >= 0 (0: none), "
                f"got {self.shared_expert_intermediate_size}"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(
                "model.shared_expert_gate needs a shared expert (model.shared_expert_intermediate_size > 0)"
            )
        if self.moe_score not in MOE_SCORES:
            raise ValueError(f"model.moe_score: unknown score {self.moe_score!r}; valid: {', '.join(MOE_SCORES)}")
        if self.moe_layer_step < 1:
            raise ValueError(f"model.moe_layer_step must be >= 1, got {self.moe_layer_step}")
        if not 0 <= self.first_k_dense < self.n_layers:
            raise ValueError(
                f"model.first_k_dense must be between 0 and model.n_layers - 1 ({self.n_layers - 1}), "
                f"got {self.first_k_dense}"
            )
        if not self.moe_layers:
            raise ValueError(
                f"model.moe_layer_step ({self.moe_layer_step}) leaves no MoE layer after model.first_k_dense "
                f"({self.first_k_dense}) of model.n_layers ({self.n_layers})"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"model.{name} must be a finite number >= 0, got {getattr(self, name)}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose feed-forward is a mixture of experts (none for a dense model)."""
        if not self.n_experts:
            return ()
        step = self.moe_layer_step
        return tuple(i for i in range(self.first_k_dense, self.n_layers) if (i + 1) % step == 0)

    def _check_rope(self) -> None:
        scaling = {name: getattr(self, name) for name in LLAMA3_ROPE_FIELDS}
        if self.rope_type == "default":
            for name, value in scaling.items():
                if value:
                    raise ValueError(f"model.{name} ({value}) needs model.rope_type 'llama3'")
            return
        if self.rope_type != "llama3":
            raise ValueError(f"model.rope_type: unknown type {self.rope_type!r}; valid: default, llama3")
        for name, value in scaling.items():
            if not value:
                raise ValueError(f"model.{name} must be set (> 0) with model.rope_type 'llama3'")
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"model.rope_high_freq_factor ({self.rope_high_freq_factor}) must exceed "
                f"model.rope_low_freq_factor ({self.rope_low_freq_factor})"
            )

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def llama3_rope(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_seq_len) of llama3 RoPE scaling, or None."""
        if self.rope_type != "llama3":
            return None
        return tuple(getattr(self, name) for name in LLAMA3_ROPE_FIELDS)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # The demo's model (configs/tiny.toml, `make demo`): 3.16M parameters with a 512-token vocabulary; trains
    # to a useful loss on 2 CPU cores in minutes.
    "tiny": ModelConfig(vocab_size=512),
    # ~0.25M parameters: for fast tests of every parallel layout (divisible by tp up to 4 and pp up to 4).
    "test": ModelConfig(
        vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=128, max_seq_len=64
    ),
    "small": ModelConfig(
        vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1376, max_seq_len=512
    ),
    "llama3-1b": ModelConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        intermediate_size=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-405b": ModelConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        intermediate_size=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # ~5.0M parameters (3.3M active per token): a Qwen2-MoE-style model (8 experts, top-2, a gated shared
    # expert, a dense first layer) that trains on 2 CPU cores in minutes.
    "tiny-moe": ModelConfig(
        qkv_bias=True,
        hf_model_type="qwen2_moe",
        n_experts=8,
        top_k=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        shared_expert_gate=True,
        first_k_dense=1,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
    ),
    # Mixtral 8x7B: mistralai/Mixtral-8x7B-v0.1 config.json (46.7B parameters, 12.9B active; Jiang et al. 2024).
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-5,
        hf_model_type="mixtral",
        n_experts=8,
        top_k=2,
        moe_intermediate_size=14336,
        norm_topk=True,
        aux_loss_coef=0.02,
    ),
    # Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (30.5B parameters, 3.3B active; Qwen3 technical report).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim_override=128,
        intermediate_size=6144,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        hf_model_type="qwen3_moe",
        qk_norm=True,
        n_experts=128,
        top_k=8,
        moe_intermediate_size=768,
        norm_topk=True,
        aux_loss_coef=0.001,
    ),
}


def preset(name: str) -> ModelConfig:
    """Look up a named preset, with a one-line error listing the valid names."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
