"""The LoRA layer (Hu et al. 2021): an nn.Linear plus a trainable low-rank update. A model piece, below the
parallel strategies that shard it with its base (meshlm.parallel.tp.sharding); applying, merging and
exporting adapters is meshlm.parallel.transforms.lora."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import InputError


class LoRAError(InputError):
    """A LoRA request that cannot be honoured (no target, bad rank, an adapter for another base), in one line."""


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_delta(module: nn.Module, x: torch.Tensor, lora_B: torch.Tensor | None = None) -> torch.Tensor:
    """The adapter's output (dropout(x) Aᵀ) Bᵀ · scaling for a module holding lora_A, lora_B (B replaceable:
    tensor parallel passes a replicated KV head's summed B)."""
    h = F.linear(module.lora_dropout(x), module.lora_A)
    return F.linear(h, module.lora_B if lora_B is None else lora_B) * module.lora_scaling


class LoRALinear(nn.Linear):
    """An nn.Linear (same `weight` and `bias` objects, frozen) with a trainable low-rank update."""

    def __init__(self, base: nn.Linear, spec: LoRASpec, generator: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        device = torch.device("cpu") if base.weight.is_meta else base.weight.device
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5), PEFT's and nn.Linear's default
        a = torch.rand(spec.rank, self.in_features, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        self.lora_A = nn.Parameter(a.to(device, torch.get_default_dtype()))  # as lora_B (float64 in meshlm check)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.rank, device=device))
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.lora_scaling = spec.scaling
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + lora_delta(self, x)


def lora_spec(model: nn.Module) -> LoRASpec | None:
    """The rank, alpha and dropout of `model`'s adapters (meshlm.parallel.transforms.lora.apply_lora), read off its
    LoRALinear modules; None without any. Adapters of two specs are a one-line LoRAError: one PEFT adapter
    has one rank and alpha."""
    specs = {m.spec for m in model.modules() if isinstance(m, LoRALinear)}
    if len(specs) > 1:
        raise LoRAError(f"the model's adapters have {len(specs)} different specs ({sorted(map(repr, specs))[:2]})")
    return next(iter(specs), None)
