"""Model shapes: a validated dataclass plus named presets from `tiny` to Llama-3 405B."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.dim / model.n_heads = {self.head_dim} must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
