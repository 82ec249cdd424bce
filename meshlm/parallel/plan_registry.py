"""The plan registry: `register_plan` and `plan_for`, which finds the registered plan of a model's class (else
meshlm.parallel.parallel_plan.generic_plan), and the built-in plans registered in it: meshlm's Llama and the
Hugging Face decoder families.

Every family here shares Llama's module tree (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...,
`model.norm`, `lm_head`); only these tables name those modules. Qwen2's q/k/v biases are split with their
weights by the colwise style; Mistral differs from Llama only in its attention window (checked on import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from meshlm.model.config import ModelConfig
from meshlm.model.llama import Transformer
from meshlm.parallel.mesh import LayoutError
from meshlm.parallel.parallel_plan import (
    COLWISE,
    COLWISE_HEADS,
    ROWWISE,
    SEQUENCE_PARALLEL,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    ParallelPlan,
    PipelineSplit,
    PlanError,
    SplitMoE,
    generic_plan,
)
from meshlm.parallel.tp.sizes import check_tensor_parallel

# ---- the registry ---------------------------------------------------------------------------------------
PlanSource = ParallelPlan | Callable[[nn.Module], ParallelPlan]
_PLANS: dict[type | str, PlanSource] = {}


def register_plan(model_class: type | str, plan: PlanSource) -> None:
    """Use `plan` (or `plan(model)`) for instances of `model_class` and its subclasses; a class *name* serves
    families whose package is optional (transformers), matched without importing it."""
    _PLANS[model_class] = plan


def plan_for(model: nn.Module) -> ParallelPlan:
    """The registered plan of the model's class (or nearest base), else the generic plan (DP / ZeRO only)."""
    for cls in type(model).__mro__:
        plan = _PLANS.get(cls) or _PLANS.get(cls.__name__)
        if plan is not None:
            return plan if isinstance(plan, ParallelPlan) else plan(model)
    return generic_plan(model)


DECODER_TP = {
    "model.embed_tokens": VOCAB_EMBEDDING,
    "model.layers.*.self_attn.q_proj": COLWISE,
    "model.layers.*.self_attn.[kv]_proj": COLWISE_HEADS,
    "model.layers.*.self_attn.o_proj": ROWWISE,
    "model.layers.*.mlp.gate_proj": COLWISE,
    "model.layers.*.mlp.up_proj": COLWISE,
    "model.layers.*.mlp.down_proj": ROWWISE,
    "model.layers.*.input_layernorm": SEQUENCE_PARALLEL,
    "model.layers.*.post_attention_layernorm": SEQUENCE_PARALLEL,
    "model.norm": SEQUENCE_PARALLEL,
    "lm_head": VOCAB_HEAD,
}
DECODER_UNITS = ("model.embed_tokens", "model.layers.*", ("model.norm", "lm_head"))


def _llama_stage_costs(model: nn.Module) -> tuple[float, float, float]:
    from meshlm.model.flops import part_costs

    return part_costs(model.cfg)


LLAMA = ParallelPlan(
    name="llama",
    context_parallel="model.layers.*.self_attn",
    tensor_parallel=DECODER_TP,
    zero3_units=DECODER_UNITS,
    pipeline=PipelineSplit(layers="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head")),
    sequence_parallel=True,  # rotary tables are sliced in attention, after the sequence is gathered
    head_dim=lambda model: model.cfg.head_dim,
    stage_costs=_llama_stage_costs,
    check=lambda model, tp: check_tensor_parallel(model.cfg, tp, seq_len=0, sequence_parallel=False),
)


def _hf_head_dim(model: nn.Module) -> int:
    c = model.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _hf_check(model: nn.Module, tp: int) -> None:
    """HF attention reshapes by head_dim, so local head counts follow the weights; but its GQA grouping is
    fixed at construction (num_key_value_groups), so KV heads must split evenly, not be replicated."""
    c = model.config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(c, field, None) or c.num_attention_heads
        if value % tp:
            raise LayoutError(f"{type(model).__name__} config.{field} ({value}) is not divisible by tp={tp}")


HF_DECODER = ParallelPlan(
    name="hf-decoder",
    tensor_parallel={**DECODER_TP, "model.layers.*.self_attn.[kv]_proj": COLWISE},
    zero3_units=DECODER_UNITS,
    pipeline=None,  # HF's forward cannot skip the parts a stage does not hold
    sequence_parallel=False,  # HF computes rotary positions from the (sharded) embedding output
    head_dim=_hf_head_dim,
    check=_hf_check,
)


# ---- mixture of experts (meshlm.model.moe; docs/moe.md) ------------------------------------------------------
# DP, ZeRO 0-3 (a layer, experts included, is one ZeRO-3 unit), pipeline stages and expert parallelism take MoE
# layers as they are. Under tp each MoE layer is one SplitMoE entry (meshlm.parallel.tp.moe: every expert's hidden
# units split, the router whole, the output summed over tp), dense layers keep the MLP's colwise/rowwise pair.
# Context parallelism too: meshlm's MoE layers sum their balancing statistics over the cp group.
MOE_ATTENTION_TP = {pattern: style for pattern, style in DECODER_TP.items() if ".mlp." not in pattern}
DENSE_MLP_TP = {pattern: style for pattern, style in DECODER_TP.items() if ".mlp." in pattern}
MOE_LAYER = SplitMoE(  # each parameter's dim of hidden units: stacked experts (E, h, dim) / (E, dim, h), shared MLP
    hidden=(
        ("experts.gate_proj", 1),
        ("experts.up_proj", 1),
        ("experts.down_proj", 2),
        ("shared_expert.gate_proj.weight", 0),
        ("shared_expert.up_proj.weight", 0),
        ("shared_expert.down_proj.weight", 1),
    )
)


def _moe_tensor_parallel(cfg: ModelConfig) -> dict[str, str | SplitMoE]:
    """The tp table of a meshlm MoE model: its MoE layers by index (every layer: one glob), the dense MLP's
    entries only when some layers are dense (every pattern must match a module)."""
    moe = cfg.moe_layers
    if len(moe) == cfg.n_layers:
        return {**MOE_ATTENTION_TP, "model.layers.*.mlp": MOE_LAYER}
    return {**MOE_ATTENTION_TP, **DENSE_MLP_TP, **{f"model.layers.{i}.mlp": MOE_LAYER for i in moe}}


def _refuse_hf_moe_tp(model: nn.Module, tp: int) -> None:
    raise PlanError(
        f"tp={tp}: tensor parallelism does not split mixture-of-experts layers of Hugging Face models yet "
        f"({type(model).__name__} has routed experts); use tp=1 with dp / ZeRO, or meshlm's own model under tp "
        "(docs/moe.md)"
    )


LLAMA_MOE = dataclasses.replace(LLAMA, name="llama-moe")
HF_MOE = dataclasses.replace(HF_DECODER, name="hf-moe", tensor_parallel=MOE_ATTENTION_TP, check=_refuse_hf_moe_tp)


def _llama_plan(model: nn.Module) -> ParallelPlan:
    if not model.cfg.n_experts:
        return LLAMA
    return dataclasses.replace(LLAMA_MOE, tensor_parallel=_moe_tensor_parallel(model.cfg))


register_plan(Transformer, _llama_plan)
for _family in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    register_plan(_family, HF_DECODER)
for _family in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
    register_plan(_family, HF_MOE)
