"""The plain single-device Llama model, its shapes and its FLOP counts."""

from meshlm.model.config import PRESETS, ModelConfig, preset
from meshlm.model.flops import flops_per_token, param_counts
from meshlm.model.llama import Transformer, cross_entropy_loss, generate

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
