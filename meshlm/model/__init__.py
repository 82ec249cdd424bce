"""The plain single-device Llama model, its shapes and its FLOP counts.

Shapes and FLOP counts need no torch; the model itself is imported on first use, so the planner and the
config parser (`meshlm plan`, `meshlm config show`) start without loading torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshlm.model.config import PRESETS, ModelConfig, preset
from meshlm.model.flops import flops_per_token, param_counts

if TYPE_CHECKING:
    from meshlm.model.llama import Transformer, cross_entropy_loss, generate

_TORCH_NAMES = {"Transformer", "cross_entropy_loss", "generate"}  # from meshlm.model.llama

__all__ = [
    "PRESETS",
    "ModelConfig",
    "Transformer",
    "cross_entropy_loss",
    "flops_per_token",
    "generate",
    "param_counts",
    "preset",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("meshlm.model.llama"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
