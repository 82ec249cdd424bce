"""The built-in parallel plans: meshlm's Llama and the Hugging Face decoder families.

Every family here shares Llama's module tree (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...,
`model.norm`, `lm_head`); only these tables name those modules. Qwen2's q/k/v biases are split with their
weights by the colwise style; Mistral differs from Llama only in its attention window (checked on import).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from meshlm.model.llama import Transformer
from meshlm.parallel.mesh import LayoutError, check_tensor_parallel
from meshlm.parallel.plan import (
    COLWISE,
    COLWISE_HEADS,
    ROWWISE,
    SEQUENCE_PARALLEL,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    ParallelPlan,
    PipelineSplit,
    PlanError,
    register_plan,
)

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
# DP, ZeRO 0-3 (a layer, experts included, is one ZeRO-3 unit) and pipeline stages take MoE layers as they are;
# context parallelism too: meshlm's MoE layers sum their balancing statistics over the cp group.
# Tensor parallelism does not split routed experts yet: refused in one line. The attention-only table below only
# lets the refusal name the reason (check_plan matches every pattern before it calls `check`).
MOE_ATTENTION_TP = {pattern: style for pattern, style in DECODER_TP.items() if ".mlp." not in pattern}


def _refuse_moe_tp(model: nn.Module, tp: int) -> None:
    raise PlanError(
        f"tp={tp}: tensor parallelism does not split mixture-of-experts layers yet ({type(model).__name__} has "
        "routed experts); use tp=1 with dp / ZeRO / pp (docs/moe.md)"
    )


LLAMA_MOE = dataclasses.replace(LLAMA, name="llama-moe", tensor_parallel=MOE_ATTENTION_TP, check=_refuse_moe_tp)
HF_MOE = dataclasses.replace(HF_DECODER, name="hf-moe", tensor_parallel=MOE_ATTENTION_TP, check=_refuse_moe_tp)


def _llama_plan(model: nn.Module) -> ParallelPlan:
    return LLAMA_MOE if model.cfg.n_experts else LLAMA


register_plan(Transformer, _llama_plan)
for _family in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    register_plan(_family, HF_DECODER)
for _family in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
    register_plan(_family, HF_MOE)
