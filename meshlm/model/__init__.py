"""The plain single-device Llama model, its shapes and its FLOP counts.

Shapes and FLOP counts need no torch; the model itself is imported on first use, so the planner and the
config parser (`meshlm plan`, `meshlm config show`) start without loading torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.lazy import lazy_attributes
from meshlm.model.config import PRESETS, ModelConfig, preset
from meshlm.model.flops import flops_per_token, param_counts

if TYPE_CHECKING:
    from meshlm.model.llama import IGNORE_INDEX, Transformer, cross_entropy_loss, generate, token_cross_entropy


__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "ModelConfig",
    "Transformer",
    "cross_entropy_loss",
    "flops_per_token",
    "generate",
    "param_counts",
    "preset",
    "token_cross_entropy",
]

__getattr__ = lazy_attributes(
    __name__,
    dict.fromkeys(
        ("IGNORE_INDEX", "Transformer", "cross_entropy_loss", "generate", "token_cross_entropy"), "meshlm.model.llama"
    ),
)
