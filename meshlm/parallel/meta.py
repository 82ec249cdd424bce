"""Dry runs on the meta device, before any work starts: a module's forward with every parameter and buffer
swapped, for the call only, for a meta tensor of its shape, on a meta batch of one row of two tokens. Nothing
is computed or allocated, so a check costs milliseconds at any model size and every rank reaches the same
verdict without communicating. The module itself is left as it was. The engine checks the loss contract with
them, the pipeline each stage's forward, tensor parallel's probe finds its blocks' inputs.

A forward that meta tensors cannot run (a data-dependent shape such as a mixture-of-experts' token routing,
`.item()`) proves nothing; `meta_forward` returns what it raised, as a `MetaFailure`, for the caller to judge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

PROBE_SHAPE = (1, 2)  # rows × tokens of the meta batch


@dataclass(frozen=True)
class MetaFailure:
    """What a forward raised on the meta device."""

    error: Exception

    @property
    def missing_part(self) -> bool:
        """Whether it called or read a part the module holds as None (not the meta device's doing)."""
        return isinstance(self.error, (TypeError, AttributeError)) and "NoneType" in str(self.error)


def meta_tokens() -> torch.Tensor:
    return torch.zeros(PROBE_SHAPE, dtype=torch.long, device="meta")


def meta_hidden(module: nn.Module, width: int) -> torch.Tensor:
    """The activations a pipeline stage after the first receives, in the module's floating dtype."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return torch.zeros((*PROBE_SHAPE, width), dtype=dtype, device="meta")


def meta_forward(module: nn.Module, x: torch.Tensor, then: Callable[[object], object] | None = None) -> object:
    """`module(x)`, then `then` of its output, on meta tensors under no_grad; a MetaFailure if it raised."""
    swapped = {name: t.to("meta") for name, t in [*module.named_parameters(), *module.named_buffers()]}
    try:
        with torch.no_grad():
            out = functional_call(module, swapped, (x,), tie_weights=True, strict=False)
            return out if then is None else then(out)
    except Exception as e:  # judged by the caller: a missing part, a bad loss, or only the meta device
        return MetaFailure(e)
