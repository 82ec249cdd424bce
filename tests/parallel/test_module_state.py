"""meshlm keeps its state off the user's modules (issue #50 item 4): adapting and parallelizing a model adds no
attribute to any module the model had. What meshlm needs to know about a module is a constructor argument of
one of its own modules (Transformer's `init_source`, LoRALinear's `spec`, MoE's run settings), or is read off
the model (`lora_spec`).

Mutations: with `model.lora_spec = spec` put back at the end of apply_lora, the first two tests fail naming the
root module and `lora_spec`; with swap_to_fp8 setting `module.fp8_emulate = emulate` on each Linear it swaps (instead
of choosing EmulatedFloat8Linear), the third fails naming those layers and `fp8_emulate`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshlm
from meshlm.model import Transformer, preset
from meshlm.model.lora import LoRAError, LoRALinear, LoRASpec, lora_spec
from meshlm.model.moe import MoE
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.transforms.fp8 import EmulatedFloat8Linear
from meshlm.parallel.transforms.lora import apply_lora, merge_lora

MOE = preset("test").replace(hf_model_type="mixtral", n_experts=4, top_k=2, moe_intermediate_size=32)


def _attributes(model: nn.Module) -> list[tuple[str, nn.Module, set[str]]]:
    """Each module of `model` with its name and the names in its __dict__ (holding the module, so that the id
    of one the model drops is not reused by a new one)."""
    return [(name, m, set(vars(m))) for name, m in model.named_modules()]


def _gained(before: list[tuple[str, nn.Module, set[str]]], model: nn.Module) -> dict[str, set[str]]:
    """The attributes each module that was in `model` before has gained since (modules replaced aside)."""
    now = {id(m) for m in model.modules()}
    return {name: set(vars(m)) - names for name, m, names in before if id(m) in now and set(vars(m)) - names}


def test_apply_lora_sets_no_attribute_and_its_spec_is_read_off_the_adapters() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("test"))
    before = _attributes(model)
    chosen = apply_lora(model, rank=4, alpha=8.0, dropout=0.1)
    assert chosen and _gained(before, model) == {}
    assert lora_spec(model) == LoRASpec(4, 8.0, 0.1)
    assert lora_spec(merge_lora(model)) is None

    torch.manual_seed(0)
    mixed = Transformer(preset("test"))
    apply_lora(mixed, rank=4, targets=["*.q_proj"])
    first = next(m for m in mixed.modules() if isinstance(m, LoRALinear))
    apply_lora(mixed, rank=2, targets=["*.v_proj"])  # adapters of two ranks: no one PEFT adapter holds both
    assert first.spec == LoRASpec(4, 4.0)
    with pytest.raises(LoRAError, match="2 different specs"):
        lora_spec(mixed)


def test_parallelizing_sets_no_attribute_on_the_users_modules() -> None:
    """In one process (dp=1, two micro-batches: the engine sets the MoE layers' aux-loss scale), a MoE model
    adapted with LoRA by hand, then parallelized: every module the model had keeps the attribute names it had
    (a module replaced, as LoRA replaces the Linear layers it adapts, is no longer the model's)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = Transformer(MOE)
    before = _attributes(model)
    apply_lora(model, rank=4)
    pm = meshlm.parallelize(model, build_mesh(parse_layout("dp=1", 1), "cpu"), {"micro_batches": 2})
    assert _gained(before, model) == {}
    moe = [m for chunk in pm.chunks for m in chunk.modules() if isinstance(m, MoE)]
    assert moe and {m.aux_loss_scale for m in moe} == {0.5}  # the engine's setting reached its own layers


def test_fp8_sets_no_attribute_on_the_layers_it_swaps() -> None:
    """Emulated FP8 gives the blocks' Linear layers meshlm's fp8 class (EmulatedFloat8Linear: the emulation is
    the class's, not an attribute of the layer)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = Transformer(preset("test"))
    before = _attributes(model)
    pm = meshlm.parallelize(model, build_mesh(parse_layout("dp=1", 1), "cpu"), {"fp8": "emulate"})
    assert _gained(before, model) == {}
    assert any(isinstance(m, EmulatedFloat8Linear) for chunk in pm.chunks for m in chunk.modules())
