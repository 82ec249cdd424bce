"""Model shapes: a validated dataclass plus named presets from `tiny` to Llama-3 405B."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

HF_MODEL_TYPES = ("llama", "qwen2", "mistral")
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
# Fields added after checkpoints recorded ModelConfig: one that lacks them holds a plain Llama (the defaults).
FAMILY_FIELDS = ("head_dim_override", "qkv_bias", "rope_type", *LLAMA3_ROPE_FIELDS, "sliding_window", "hf_model_type")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder. Field names follow the usual Llama vocabulary."""

    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    intermediate_size: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Hugging Face families beyond plain Llama. The defaults are plain Llama, so a model without these
    # fields (a checkpoint written before they existed) is the same model; 0 means unset.
    head_dim_override: int = 0  # width of one attention head; 0: dim // n_heads
    qkv_bias: bool = False  # biases on q/k/v_proj, none on o_proj (Qwen2)
    rope_type: str = "default"  # or "llama3": Llama 3.1+ frequency scaling, by the four rope_* fields below
    rope_factor: float = 0.0
    rope_low_freq_factor: float = 0.0
    rope_high_freq_factor: float = 0.0
    rope_original_max_seq_len: int = 0
    # Mistral's attention window (0: none). meshlm runs full causal attention, which is the same function for
    # sequences of at most this many tokens; longer ones are refused.
    sliding_window: int = 0
    hf_model_type: str = "llama"  # the Hugging Face family export writes: llama, qwen2 or mistral

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
        if self.qkv_bias != (self.hf_model_type == "qwen2"):
            raise ValueError(
                f"model.qkv_bias={self.qkv_bias} does not fit model.hf_model_type {self.hf_model_type!r} "
                "(only qwen2 has q/k/v biases, and it always has them)"
            )
        if self.sliding_window and self.hf_model_type != "mistral":
            raise ValueError(f"model.sliding_window needs model.hf_model_type 'mistral', got {self.hf_model_type!r}")

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
    # ~2.6M parameters: trains to a useful loss on 2 CPU cores in minutes.
    "tiny": ModelConfig(),
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
}


def preset(name: str) -> ModelConfig:
    """Look up a named preset, with a one-line error listing the valid names."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
