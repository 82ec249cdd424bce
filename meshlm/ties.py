"""Tied weights, read off the module graph: one Parameter object held by two modules (an embedding and the output
head that reuses it, as in Llama 3.2, Qwen2.5 ≤ 3B, Gemma, GPT-2).

A tie has a *canonical* name, the first under which `named_parameters()` yields the Parameter (HF's
`model.embed_tokens.weight` for a Llama), and *aliases* (`lm_head.weight`). meshlm names a tied weight by its
canonical name wherever a name leaves a model: checkpoints save it once under it, initialisation draws it
under it (so a pipeline's last stage, which sees only the alias, gets the same values), and Hugging Face
exports store it once under it. Nothing here reads a config field: a model is tied because its modules share
a Parameter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Each alias of a tied Parameter of `module` -> its canonical name (empty for an untied model)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def canonical_state(module: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """`state` with every tie under its canonical name only: a tie may be stored under any one of its names
    (a training checkpoint and HF use the canonical one, safetensors' `save_model` either). Two different
    tensors under two names of one tie are a one-line ValueError naming `where`, never silently one of them."""
    aliases = tied_aliases(module)
    out = {name: t for name, t in state.items() if name not in aliases}
    for alias, canonical in aliases.items():
        if alias not in state:
            continue
        if canonical in out and not torch.equal(out[canonical], state[alias]):
            raise ValueError(
                f"{where}: {alias} and {canonical} are one tied weight in the model but differ in the checkpoint"
            )
        out.setdefault(canonical, state[alias])
    return out


def unique_state_names(module: nn.Module) -> list[str]:
    """The names of `module.state_dict()` with each tie under its canonical name only: what a checkpoint of
    it holds."""
    aliases = tied_aliases(module)
    return [name for name in module.state_dict(keep_vars=True) if name not in aliases]


def load_state(module: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load a state dict that stores each tie once (under any of its names) into `module`, strictly: a
    missing or unexpected tensor is a one-line ValueError naming `where` and the tensor."""
    state = canonical_state(module, state, where)
    expected = unique_state_names(module)
    for name in expected:
        if name not in state:
            raise ValueError(f"{where}: missing tensor {name}")
    for name in sorted(state.keys() - set(expected)):
        raise ValueError(f"{where}: unexpected tensor {name}")
    aliases = tied_aliases(module)
    module.load_state_dict({**state, **{alias: state[c] for alias, c in aliases.items()}})
