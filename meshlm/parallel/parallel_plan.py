"""Parallel plans: what each strategy needs to know about a model family, as a small table.

The strategies never name a model's attributes. Tensor parallelism asks the plan which modules to split and
how, ZeRO-3 which modules form a gather/free unit, pipeline parallelism where the layers are and which
modules only the first or the last stage runs. A new model family is one `ParallelPlan`:

    ParallelPlan(
        name="gpt2",
        tensor_parallel={"h.*.attn.c_attn": FusedColwise(3), "h.*.attn.c_proj": ROWWISE, "h.*.mlp.c_fc": COLWISE,
                         "h.*.mlp.c_proj": ROWWISE, "wte": VOCAB_EMBEDDING, "head": VOCAB_HEAD},
        zero3_units=("Block",),
        pipeline=PipelineSplit(layers="h", first=("wte", "wpe"), last=("ln_f", "head")),
    )

Patterns are `fnmatch` globs over module names (`model.layers.*.self_attn.q_proj`); ZeRO-3 units match a
module name or a class name, and a tuple of patterns makes one unit of several modules. `plan_for(model)`
picks the registered plan of a model's class (the built-in families: meshlm.parallel.plan_registry), else
`generic_plan`, a data-parallel / ZeRO plan. Each strategy's plan rules live in its own folder
(meshlm.parallel.tp.rules, dp.rules, pp.rules, cp.attention, ep.experts); its `check` (run by
meshlm.parallel.strategies.check_layout) validates the plan against a model and a layout before anything is
changed, so nothing is ever trained on a half-applied plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from torch import nn

from meshlm.parallel.mesh import LayoutError

# ---- tensor-parallel styles ---------------------------------------------------------------------------
COLWISE = "colwise"  # Linear: output features (weight rows, bias) split; input = the full activation
COLWISE_HEADS = "colwise_heads"  # COLWISE at attention-head boundaries; fewer heads than ranks are replicated
ROWWISE = "rowwise"  # Linear: input features split; partial outputs summed over tp, bias added once
VOCAB_EMBEDDING = "vocab_embedding"  # Embedding: vocabulary rows split; lookups summed over tp
VOCAB_HEAD = "vocab_head"  # output Linear: vocabulary rows split; logits vocab-sharded or gathered
SEQUENCE_PARALLEL = "sequence_parallel"  # a module run on sequence shards under SP (norms): its grads summed
TP_STYLES = (COLWISE, COLWISE_HEADS, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD, SEQUENCE_PARALLEL)
LINEAR_STYLES = (COLWISE, COLWISE_HEADS, ROWWISE, VOCAB_HEAD)


@dataclass(frozen=True)
class FusedColwise:
    """COLWISE for a Linear whose output features are blocks laid end to end: GPT-2's c_attn [Q | K | V],
    Phi-3's qkv_proj (Q, K, V of unequal widths under grouped-query attention) and gate_up_proj [gate | up].
    Every tp rank keeps its slice of every block, so its output is [q_r | k_r | v_r] and the model's own split
    (by proportion: `chunk`, or sizes read from the local width) runs unchanged on its heads.

    `blocks`: the number of equal blocks, or each block's width in output features, or a function of the
    model giving those widths. With `heads`, each block is split at attention-head boundaries
    (`ParallelPlan.head_dim`), so a block's head count must be divisible by tp."""

    blocks: int | tuple[int, ...] | Callable[[nn.Module], Sequence[int]]
    heads: bool = False

    def __str__(self) -> str:
        blocks = "<function>" if callable(self.blocks) else self.blocks
        return f"FusedColwise(blocks={blocks}{', heads=True' if self.heads else ''})"

    def widths(self, model: nn.Module, out_features: int) -> tuple[int, ...]:
        if isinstance(self.blocks, int):
            return (out_features // self.blocks,) * self.blocks if self.blocks > 0 else ()
        return tuple(int(b) for b in (self.blocks(model) if callable(self.blocks) else self.blocks))


@dataclass(frozen=True)
class InterleavedColwise:
    """COLWISE for a Linear whose output features interleave per attention head: GPT-NeoX's query_key_value
    is, for each head h, [q_h | k_h | v_h] (`per_head=3`). A rank keeps whole heads (each `per_head` ×
    `ParallelPlan.head_dim` features), so the head count must be divisible by tp."""

    per_head: int = 3


FUSED_STYLES = (FusedColwise, InterleavedColwise)


@dataclass(frozen=True)
class SplitMoE:
    """A mixture-of-experts layer (meshlm.model.moe.MoE) split over tp as Megatron-Core's expert tensor
    parallelism does (meshlm.parallel.tp.moe): each parameter in `hidden` — a name inside the layer and the
    dim that indexes its hidden units — keeps this rank's tp-th along that dim (every expert's gate/up rows
    and down columns, and the shared expert's); every other parameter of the layer (the router, the shared
    expert's gate) stays whole and sums its gradient over tp. The layer's input opens the tensor-parallel
    region once and its output is reduced once. A name under a part the layer does not have (None: no
    shared expert) is skipped."""

    hidden: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return "moe"


Style = str | FusedColwise | InterleavedColwise | SplitMoE


class PlanError(LayoutError):
    """A plan that does not fit the model or the layout, phrased as one line naming the module."""


@dataclass(frozen=True)
class PipelineSplit:
    """Where a model's layers are, for cutting it into contiguous pipeline stages.

    `layers` is the dotted name of the ModuleList/ModuleDict of blocks; `first` the modules only the first
    stage runs (embeddings), `last` those only the last stage runs (final norm, head). A stage keeps its
    slice of the blocks and sees the modules it does not own as None, so the model's forward must skip a
    None part (as meshlm's Transformer and torchtitan's models do) and loop over the blocks it holds."""

    layers: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    hidden_size: int | None = None  # activation width between stages; default: the first-stage embedding's


@dataclass(frozen=True)
class ParallelPlan:
    """One model family's table for every strategy (see the module docstring)."""

    name: str
    tensor_parallel: dict[str, Style] = field(default_factory=dict)
    zero3_units: tuple[str | tuple[str, ...], ...] = ()
    pipeline: PipelineSplit | None = None
    sequence_parallel: bool = False  # whether the family's forward runs on sequence shards (rotary, no abs. pos.)
    head_dim: Callable[[nn.Module], int] | None = None  # width of one attention head, for COLWISE_HEADS
    context_parallel: str = ""  # pattern of the attention modules whose replaceable `core` cp swaps (cp > 1)
    attention: str = ""  # pattern of attention-core modules, forward (q, k, v) -> out, that cp replaces (cp > 1)
    positions: str = ""  # pattern of modules fed local positions 0..n-1; under cp they get the global ones
    stage_costs: Callable[[nn.Module], tuple[float, float, float]] | None = None  # (first, per layer, last)
    check: Callable[[nn.Module, int], None] | None = None  # family-specific tp checks (one-line LayoutError)

    def tp_style(self, module_name: str) -> Style | None:
        for pattern, style in self.tensor_parallel.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return style
        return None


def tp_modules(model: nn.Module, plan: ParallelPlan) -> Iterator[tuple[str, nn.Module, Style]]:
    """(name, module, style) of every module the plan splits, in registration order."""
    for name, module in model.named_modules():
        style = plan.tp_style(name) if name else None
        if style is not None:
            yield name, module, style


def zero3_unit_groups(chunk: nn.Module, plan: ParallelPlan) -> list[list[nn.Module]]:
    """The modules of each ZeRO-3 unit, in forward (registration) order: the chunk itself first (it catches
    every parameter outside the units), then one unit per plan entry match. A tuple entry gathers all its
    matches as one unit; modules a pipeline stage does not hold (None) simply do not match."""
    groups: list[list[nn.Module]] = [[chunk]]
    taken: set[nn.Module] = set()
    for name, module in chunk.named_modules():
        if not name or module in taken:
            continue
        for entry in plan.zero3_units:
            patterns = entry if isinstance(entry, tuple) else (entry,)
            if not matches_unit(name, module, patterns):
                continue
            if isinstance(entry, tuple):
                group = [m for n, m in chunk.named_modules() if n and matches_unit(n, m, patterns) and m not in taken]
            else:
                group = [module]
            taken.update(m for g in group for m in g.modules())
            groups.append(group)
            break
    return groups


def matches_unit(name: str, module: nn.Module, patterns: tuple[str, ...]) -> bool:
    """A module matches a ZeRO-3 unit's patterns by its name (a glob) or its class name."""
    return any(fnmatch.fnmatchcase(name, p) or type(module).__name__ == p for p in patterns)


def module_examples(names: dict[str, nn.Module], limit: int = 6) -> str:
    """The first module names of a model, for an error naming what a plan could have matched."""
    shown = [n for n in names if n][:limit]
    return ", ".join(shown) + (", ..." if len(names) - 1 > limit else "")


def generic_plan(model: nn.Module) -> ParallelPlan:
    """Any nn.Module: no tensor or pipeline split; ZeRO-3 units are the entries of its largest ModuleList or
    ModuleDict (its blocks), or else its direct children that hold parameters."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if containers:
        name, blocks = max(containers, key=lambda c: sum(p.numel() for p in c[1].parameters()))
        units = tuple(f"{name}.{key}" for key, _ in blocks.named_children())
    else:
        units = tuple(n for n, m in model.named_children() if any(True for _ in m.parameters()))
    return ParallelPlan(name=f"generic:{type(model).__name__}", zero3_units=units)
