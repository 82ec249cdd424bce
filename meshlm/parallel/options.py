"""The engine's options, declared once: how each strategy and transform runs on the mesh, beyond the mesh's sizes,
and the loss the step averages.

Everything else derives from these declarations: the run config's `[parallel]` section (meshlm.config.ParallelSection
is generated from the fields of PARALLEL_SECTION, plus the layout, which builds the mesh, and the timeout, which sets
up the process group) and the fields of its `[train]` section that are options of the engine (TRAIN_SECTION: fp8,
compile_backend; the Loss's `ignore_index` and `fused` as train.ignore_index and train.fused_loss), so `--help` and
`meshlm config reference` print these descriptions; the library API's `meshlm.parallelize(model, mesh, options,
loss=...)`; the layout checks' `LayoutSpec.options` (meshlm.parallel.strategies); the planner's candidates
(meshlm.plan.memory.Candidate.options). tests/unit/test_options.py fails if one of them re-declares an option.
A new strategy's option is one field here. The engine never imports the config, so `meshlm.parallel` sits
below it in meshlm's layers (tests/unit/test_layers.py); this module needs no torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from meshlm.errors import InputError

KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _takes_bool(annotation: object) -> bool:
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(arg, bool) for arg in get_args(annotation))
    return any(_takes_bool(arg) for arg in get_args(annotation))


def refuse_bool(model: type[BaseModel], value: object, info: ValidationInfo) -> object:
    """A true or false given for a field that takes no bool (a number) is refused, not read as 1 or 0
    (pydantic's lax mode would: `[parallel] zero = true` became ZeRO-1)."""
    field = model.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
        kinds = [KIND_NAMES.get(arg, "") for arg in (field.annotation, *get_args(field.annotation))]
        expected = next((kind for kind in kinds if kind), "a value of the field's type")
        raise ValueError(f"Input should be {expected}, not {str(value).lower()}")
    return value


class OneLineOptions(BaseModel):
    """Options validated like a config section (`section`): a bad value is one line naming the field, not a
    traceback."""

    section: ClassVar[str]

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: object, info: ValidationInfo) -> object:
        return refuse_bool(cls, value, info)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            error = e.errors()[0]
            field = ".".join(str(part) for part in error["loc"])
            raise InputError(f"{self.section}.{field}: {error['msg'].removeprefix('Value error, ')}") from None


class ParallelOptions(OneLineOptions):
    """The engine's options: how each strategy runs on the mesh, how a step runs (its micro-batches, its autocast
    dtype) and the transforms after the strategies (FP8, compile). Bad values raise a one-line InputError naming
    the field."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    section: ClassVar[str] = "parallel"

    zero: int = Field(0, ge=0, le=3, description="ZeRO stage: 1 shards optimizer state, 2 + grads, 3 + params")
    zero_shard_size: int | None = Field(
        None, gt=0, description="hybrid sharding: shard within groups of this many dp ranks, replicate across"
    )
    zero_param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="ZeRO ≥ 1: dtype of the working (gathered) weights over fp32 master shards; auto: bf16 "
        "under bf16 autocast on CUDA, else fp32",
    )
    zero_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype gradients are summed in across data-parallel ranks (bf16 halves the traffic)"
    )
    grad_accum_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="ZeRO ≥ 1, bf16 working weights: dtype gradients accumulate in over the micro-batches "
        "(fp32 as FSDP2 and Megatron do; bf16 halves the buffer but rounds the sum every micro-batch)",
    )
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size of the overlapped reduction")
    sequence_parallel: bool = Field(False, description="shard norms/residuals along the sequence over tp")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = Field(
        "1f1b", description="pipeline schedule (zb1: zero-bubble ZB-H1, weight gradients fill the bubble)"
    )
    virtual_stages: int = Field(1, gt=0, description="model chunks per pipeline rank (interleaved)")
    cp_attention: Literal["ring", "ulysses"] = Field(
        "ring", description="context parallel (layout cp > 1): KV ring with send/recv, or all-to-all heads"
    )
    # The step's and the transforms' options: the run config's [train] section sets them (TRAIN_SECTION), or
    # the trainer derives them from it (micro_batches, autocast_dtype, compile: DERIVED below).
    micro_batches: int = Field(
        1,
        gt=0,
        description="micro-batches each replica's batch is cut into per step (accumulation; pp's micro-batches)",
    )
    autocast_dtype: Literal["bf16", "fp16"] | None = Field(
        None, description="the forward runs under torch.autocast to this dtype; None: as the weights are (fp32)"
    )
    fp8: bool | Literal["emulate"] = Field(
        False,
        description="FP8 matmuls (e4m3 forward, e5m2 gradients, tensorwise dynamic scales) in the blocks' Linear "
        "layers; needs an FP8 GPU (Ada, Hopper or later); emulate: the same quantisation through an fp32 matmul, "
        "on any device",
    )
    compile: bool = Field(False, description="torch.compile each transformer block, after the parallel transforms")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="torch.compile backend: inductor generates kernels; aot_eager only traces (tests)"
    )

    @classmethod
    def of(cls, source: ParallelOptions | dict[str, Any] | None) -> ParallelOptions:
        """`source` itself (a ParallelOptions), the options a dict of its fields names, or the defaults for None
        (the run config's ParallelSection is not one: its `options()` are)."""
        if isinstance(source, cls):
            return source
        if source is None:
            return cls()
        if not isinstance(source, dict):
            raise InputError(
                f"parallel options: expected ParallelOptions or a dict of its fields, got {type(source).__name__}"
            )
        return cls(**source)


PARALLEL_SECTION = (
    "zero", "zero_shard_size", "zero_param_dtype", "zero_reduce_dtype", "grad_accum_dtype", "bucket_mb",
    "sequence_parallel", "schedule", "virtual_stages", "cp_attention",
)  # fmt: skip
"""The options the run config's `[parallel]` section sets, by their names."""
TRAIN_SECTION = ("fp8", "compile_backend")
"""The options the run config's `[train]` section sets, by their names."""
DERIVED = {
    "micro_batches": "train.global_batch / (dp × ep × train.micro_batch)",
    "autocast_dtype": "train.dtype on the device (auto: bf16 on CUDA, else none)",
    "compile": "train.compile on the device (auto: on CUDA only)",
}
"""The options the trainer derives from the run config, and from what."""


def option_fields(names: tuple[str, ...]) -> dict[str, tuple[Any, FieldInfo]]:
    """ParallelOptions' fields `names` as pydantic's create_model takes them, for the run config's sections
    (meshlm.config): the same type, default, bounds and description."""
    fields = ParallelOptions.model_fields
    return {name: (fields[name].annotation, copy.copy(fields[name])) for name in names}


class LoRAOptions(OneLineOptions):
    """LoRA adapters on a frozen base (meshlm.parallel.transforms.lora; the run config's `[lora]` section is one).
    Bad values raise a one-line InputError naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    section: ClassVar[str] = "lora"

    rank: int = Field(0, ge=0, description="LoRA adapter rank; 0 = off (every weight trains unless train.freeze)")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: the update is B·A·alpha/rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (0 for exact layouts)")
    targets: list[str] = Field(
        [],
        description="module-name patterns of the Linears to adapt; empty = the plan's attention and MLP projections",
    )
    init_from: str | None = Field(None, description="start the adapters from a PEFT adapter directory")


@dataclass(frozen=True)
class Loss:
    """The loss `forward_backward` averages over a global batch's kept tokens (meshlm.parallel.engine).

    `fn(output, targets)` returns per-token losses (None: token cross-entropy, vocabulary-parallel under tp);
    targets equal to `ignore_index` carry none. `gather_logits` makes a tp model return full logits (a loss
    of one's own under tp needs it); `fused` computes the default loss together with the vocabulary head,
    chunk by chunk, never materialising the logits in training (meshlm.parallel.transforms.fused_loss). The run config's
    train.ignore_index and train.fused_loss are `ignore_index` and `fused` (meshlm.config generates them from
    these declarations; `meshlm train` fuses by default, as its loop never reads the logits)."""

    fn: Callable[[Any, Any], Any] | None = None
    ignore_index: int = field(
        default=-100, metadata={"description": "target id that carries no loss (prompt and padding labels)"}
    )
    gather_logits: bool = False
    fused: bool = field(
        default=False,
        metadata={"description": "output projection + cross-entropy in token chunks, never materialising the logits"},
    )


def loss_field(name: str, **default: Any) -> tuple[Any, FieldInfo]:
    """The Loss's field `name` as a run config field (train.ignore_index, train.fused_loss): its type, default
    and description, or the config's own `default` where it has one (`meshlm train` fuses the loss: its loop
    never reads the logits)."""
    declared = Loss.__dataclass_fields__[name]
    return get_type_hints(Loss)[name], Field(default.get("default", declared.default), **declared.metadata)


__all__ = ["LoRAOptions", "Loss", "ParallelOptions"]
