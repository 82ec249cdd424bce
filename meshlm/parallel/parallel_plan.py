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
picks the registered plan of a model's class, else a generic data-parallel / ZeRO plan. The strategies'
`check`s (meshlm.parallel.strategies.check_layout) validate a plan against a model and a layout before anything
is changed, so nothing is ever trained on a
half-applied plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from torch import nn

from meshlm.model.lora import LoRALinear
from meshlm.model.moe import MoE
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
            if not _matches(name, module, patterns):
                continue
            if isinstance(entry, tuple):
                group = [m for n, m in chunk.named_modules() if n and _matches(n, m, patterns) and m not in taken]
            else:
                group = [module]
            taken.update(m for g in group for m in g.modules())
            groups.append(group)
            break
    return groups


def _matches(name: str, module: nn.Module, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or type(module).__name__ == p for p in patterns)


# ---- checking a plan against a model and a layout -----------------------------------------------------
def check_tp_plan(model: nn.Module, plan: ParallelPlan, tp: int, sequence_parallel: bool) -> None:
    """The plan's tensor_parallel table applies to `model` at `tp` (> 1): every pattern matches, every style
    fits its module, ties are sharded alike; then the plan's own `check`."""
    cls = type(model).__name__
    names = dict(model.named_modules())
    if not plan.tensor_parallel:
        raise PlanError(f"plan {plan.name!r} for {cls} has no tensor_parallel table; tp={tp} needs one")
    if sequence_parallel and not plan.sequence_parallel:
        raise PlanError(
            f"plan {plan.name!r}: {cls} does not support parallel.sequence_parallel (its forward needs the "
            "full sequence, e.g. learned positions); use sequence_parallel = false"
        )
    for pattern, style in plan.tensor_parallel.items():
        if not isinstance(style, (*FUSED_STYLES, SplitMoE)) and style not in TP_STYLES:
            raise PlanError(
                f"plan {plan.name!r}: style {style!r} for {pattern!r}; valid: {', '.join(TP_STYLES)}, "
                "FusedColwise(blocks), InterleavedColwise(per_head), SplitMoE(hidden)"
            )
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names if n):
            raise PlanError(
                f"plan {plan.name!r}: tensor_parallel pattern {pattern!r} matches no module of {cls} "
                f"(modules: {_examples(names)})"
            )
    for name, module, style in tp_modules(model, plan):
        check_linear_style(plan, model, name, module, style, tp)
    _check_tp_ties(model, plan, tp)
    if plan.check is not None:
        plan.check(model, tp)


def check_zero3_units(model: nn.Module, plan: ParallelPlan) -> None:
    """Every entry of the plan's zero3_units matches a module name or class of `model`."""
    cls = type(model).__name__
    names = dict(model.named_modules())
    for entry in plan.zero3_units:
        patterns = entry if isinstance(entry, tuple) else (entry,)
        for pattern in patterns:
            if not any(_matches(n, m, (pattern,)) for n, m in names.items() if n):
                raise PlanError(
                    f"plan {plan.name!r}: zero3_units entry {pattern!r} matches no module name or class of "
                    f"{cls} (modules: {_examples(names)})"
                )


def check_linear_style(
    plan: ParallelPlan,
    model: nn.Module,
    name: str,
    module: nn.Module,
    style: Style,
    tp: int,
) -> None:
    where = f"plan {plan.name!r}: module {name} ({type(module).__name__}, {style})"
    if isinstance(style, SplitMoE):
        _check_moe_module(where, module, style, tp)
        return
    if isinstance(style, FUSED_STYLES):
        if not isinstance(module, nn.Linear):
            raise PlanError(f"{where}: {type(style).__name__} splits an nn.Linear; this module is not one")
        fused_widths(plan, model, name, module, style, tp)
        return
    if style in LINEAR_STYLES and not isinstance(module, nn.Linear):
        raise PlanError(f"{where}: {style} splits an nn.Linear; this module is not one")
    if style == VOCAB_EMBEDDING and not isinstance(module, nn.Embedding):
        raise PlanError(f"{where}: {style} splits an nn.Embedding; this module is not one")
    if style in (COLWISE, VOCAB_HEAD) and module.out_features % tp:
        raise PlanError(f"{where}: out_features {module.out_features} is not divisible by tp={tp}")
    if style == ROWWISE and module.in_features % tp:
        raise PlanError(f"{where}: in_features {module.in_features} is not divisible by tp={tp}")
    if style == VOCAB_EMBEDDING and module.num_embeddings % tp:
        raise PlanError(f"{where}: num_embeddings {module.num_embeddings} is not divisible by tp={tp}")
    if style == COLWISE_HEADS:
        if plan.head_dim is None:
            raise PlanError(f"{where}: the plan gives no head_dim to split at head boundaries")
        head_dim = plan.head_dim(model)
        heads, rest = divmod(module.out_features, head_dim)
        if rest or (heads % tp and tp % heads):
            raise PlanError(
                f"{where}: {module.out_features} outputs = {heads} heads of {head_dim}; the head count must "
                f"divide or be divisible by tp={tp}"
            )


def _check_moe_module(where: str, module: nn.Module, style: SplitMoE, tp: int) -> None:
    if not isinstance(module, MoE):
        raise PlanError(f"{where}: SplitMoE splits a mixture-of-experts layer (meshlm.model.moe.MoE); this is not one")
    for name, owner, attr, dim in moe_split_params(where, module, style):
        shape = tuple(getattr(owner, attr).shape)
        if not 0 <= dim < len(shape):
            raise PlanError(f"{where}: {name} {shape} has no dim {dim}; valid: 0..{len(shape) - 1}")
        if shape[dim] % tp:
            raise PlanError(f"{where}: {name} {shape}: dim {dim} ({shape[dim]}) is not divisible by tp={tp}")
    if any(isinstance(m, LoRALinear) for m in module.modules()):
        raise PlanError(f"{where}: a LoRA adapter inside a mixture-of-experts layer is not supported under tp")


def moe_split_params(where: str, module: nn.Module, style: SplitMoE) -> list[tuple[str, nn.Module, str, int]]:
    """(name, owning module, attribute, dim) of each parameter of the layer that `style` splits; a name under a
    part the layer does not have (None) is skipped, one that is no parameter is a one-line PlanError."""
    out = []
    for name, dim in style.hidden:
        path, _, attr = name.rpartition(".")
        owner: object = module
        for part in filter(None, path.split(".")):
            if owner is None:
                break
            owner = getattr(owner, part, "missing")
        if owner is None:  # a part the layer does not have
            continue
        if not isinstance(owner, nn.Module) or not isinstance(owner._parameters.get(attr), nn.Parameter):
            raise PlanError(f"{where}: SplitMoE names {name!r}, which is no parameter of this layer")
        out.append((name, owner, attr, dim))
    return out


# The dimension of a module's weight and bias that each style splits (None: every tp rank holds it whole).
_WEIGHT_SPLIT = {COLWISE: 0, COLWISE_HEADS: 0, VOCAB_HEAD: 0, VOCAB_EMBEDDING: 0, ROWWISE: 1}
_BIAS_SPLIT = {COLWISE: 0, COLWISE_HEADS: 0, VOCAB_HEAD: 0}


def _split_dim(style: object, pname: str) -> int | None:
    if isinstance(style, (FusedColwise, InterleavedColwise)):  # output features (and bias) in runs
        return 0
    return (_BIAS_SPLIT if pname == "bias" else _WEIGHT_SPLIT).get(style)


def _check_tp_ties(model: nn.Module, plan: ParallelPlan, tp: int) -> None:
    """A Parameter shared by several modules (a tied embedding and head) must be split alike by all of them,
    or each would keep a different tensor and the tie would silently come undone."""
    holders: dict[int, list[tuple[str, nn.Module, str, str | None]]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            style = plan.tp_style(name) if name else None
            holders.setdefault(id(p), []).append((name, module, pname, style))
    for held in holders.values():
        if len(held) < 2:
            continue
        splits = {_split_dim(style, pname) for _, _, pname, style in held}
        embedding = next((h for h in held if isinstance(h[1], nn.Embedding)), None)
        head = next((h for h in held if isinstance(h[1], nn.Linear)), None)
        vocab_pair = embedding is not None and head is not None
        if vocab_pair and embedding[3] is not None and head[3] != VOCAB_HEAD:
            splits.add("mismatch")
        if len(splits) == 1:
            continue
        a, b = (embedding, head) if vocab_pair else (held[0], next(h for h in held if h[3] != held[0][3]))
        valid = (
            f"{a[0]}: {VOCAB_EMBEDDING} and {b[0]}: {VOCAB_HEAD}, or neither in the table"
            if vocab_pair
            else "the same style for both, or neither in the table"
        )
        raise PlanError(
            f"plan {plan.name!r}: {a[0]} ({a[3] or 'not in tensor_parallel'}) and {b[0]} "
            f"({b[3] or 'not in tensor_parallel'}) share one tied weight, which tp={tp} would split differently "
            f"and so untie; valid: {valid}"
        )


def fused_widths(
    plan: ParallelPlan,
    model: nn.Module,
    name: str,
    module: nn.Linear,
    style: FusedColwise | InterleavedColwise,
    tp: int,
) -> tuple[int, ...]:
    """The widths of the runs a fused style splits each into tp equal parts (the blocks, or for an
    interleaved style the whole output), checked: a one-line PlanError when they cannot be split exactly."""
    where = f"plan {plan.name!r}: module {name} ({type(module).__name__}, {style})"
    out = module.out_features
    head_dim = None
    if isinstance(style, InterleavedColwise) or style.heads:
        if plan.head_dim is None:
            raise PlanError(f"{where}: the plan gives no head_dim (ParallelPlan.head_dim) to split at head boundaries")
        head_dim = plan.head_dim(model)
    if isinstance(style, InterleavedColwise):
        group = max(style.per_head, 1) * head_dim
        heads, rest = divmod(out, group)
        if style.per_head < 1 or rest or heads % tp:
            raise PlanError(
                f"{where}: {out} outputs = {out / group:g} heads of {style.per_head}×{head_dim}; valid: a whole "
                f"number of heads divisible by tp={tp}"
            )
        return (out,)
    widths = style.widths(model, out)
    unit = tp * (head_dim or 1)
    if not widths or sum(widths) != out or any(w <= 0 or w % unit for w in widths):
        what = (
            f"whole heads of {head_dim}, each block's head count divisible by tp={tp}"
            if head_dim
            else (f"each divisible by tp={tp}")
        )
        raise PlanError(f"{where}: blocks {list(widths)} must sum to out_features {out} and be {what}")
    return widths


Pieces = tuple[tuple[int, int], ...]  # runs (full start, length) of a tensor along one dim


def linear_pieces(
    plan: ParallelPlan, model: nn.Module, name: str, module: nn.Linear, style: Style, tp: int, rank: int
) -> tuple[int, Pieces]:
    """(dim, runs) of a Linear's weight that tp rank `rank` keeps under a Linear style (checked already):
    output rows for the column styles (this rank's tp-th of every block for a fused one; under COLWISE_HEADS
    with fewer heads than ranks, the one head it shares), input columns for ROWWISE. The bias (and a LoRA
    factor) follows the same runs along its own dim. tensor_parallel's sharder and the build-time probe
    (meshlm.parallel.tp.probe) both cut by this one function."""
    if isinstance(style, FUSED_STYLES):
        pieces, start = [], 0
        for width in fused_widths(plan, model, name, module, style, tp):
            pieces.append((start + rank * width // tp, width // tp))
            start += width
        return 0, tuple(pieces)
    if style == ROWWISE:
        cols = module.in_features // tp
        return 1, ((rank * cols, cols),)
    if style == COLWISE_HEADS:
        head_dim = plan.head_dim(model)
        heads = module.out_features // head_dim
        if heads % tp:  # fewer heads than ranks: tp/heads consecutive ranks share one
            return 0, (((rank // (tp // heads)) * head_dim, head_dim),)
    rows = module.out_features // tp
    return 0, ((rank * rows, rows),)


def check_pipeline_split(model: nn.Module, plan: ParallelPlan, n_stages: int) -> None:
    """Every parameter must belong to a block, a first-stage or a last-stage module; with several stages a
    tied parameter may be shared by first- and last-stage modules only."""
    cls = type(model).__name__
    split = plan.pipeline
    if split is None:
        raise PlanError(f"plan {plan.name!r} for {cls} has no pipeline split; pp > 1 needs PipelineSplit(...)")
    names = dict(model.named_modules())
    for part in (split.layers, *split.first, *split.last):
        if part not in names:
            raise PlanError(f"plan {plan.name!r}: pipeline module {part!r} does not exist in {cls}")
    if not isinstance(names[split.layers], (nn.ModuleList, nn.ModuleDict)):
        raise PlanError(f"plan {plan.name!r}: pipeline layers {split.layers!r} must be an nn.ModuleList or ModuleDict")
    owners = (split.layers, *split.first, *split.last)
    for pname, _ in model.named_parameters(remove_duplicate=False):
        if not any(pname.startswith(owner + ".") for owner in owners):
            raise PlanError(
                f"plan {plan.name!r}: parameter {pname} of {cls} is in no pipeline stage; add its module to "
                f"PipelineSplit.first or .last (now first={list(split.first)}, last={list(split.last)})"
            )
    # A parameter shared by the first and the last stage's modules (a tied embedding and head) lives on both
    # stages, its gradients summed between them (pipeline.TiedStages). Any other sharing across parts (a block
    # with another block or with an end) would put one weight on stages with no such sum: refused.
    part_of: dict[int, tuple[str, str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if pname.startswith(split.layers + "."):
            part = split.layers + "." + pname[len(split.layers) + 1 :].split(".")[0]
        else:
            part = "first" if any(pname.startswith(n + ".") for n in split.first) else "last"
        seen = part_of.setdefault(id(p), (part, pname))
        if n_stages > 1 and seen[0] != part and {seen[0], part} != {"first", "last"}:
            raise PlanError(
                f"plan {plan.name!r}: {seen[1]} and {pname} of {cls} are one tied parameter in two pipeline parts; "
                "only a tie between PipelineSplit.first and .last modules (embedding and head) can be pipelined"
            )


def _examples(names: dict[str, nn.Module], limit: int = 6) -> str:
    shown = [n for n in names if n][:limit]
    return ", ".join(shown) + (", ..." if len(names) - 1 > limit else "")


# ---- the registry ---------------------------------------------------------------------------------------
PlanSource = ParallelPlan | Callable[[nn.Module], ParallelPlan]
_PLANS: dict[type | str, PlanSource] = {}


def register_plan(model_class: type | str, plan: PlanSource) -> None:
    """Use `plan` (or `plan(model)`) for instances of `model_class` and its subclasses; a class *name* serves
    families whose package is optional (transformers), matched without importing it."""
    _PLANS[model_class] = plan


def plan_for(model: nn.Module) -> ParallelPlan:
    """The registered plan of the model's class (or nearest base), else the generic plan (DP / ZeRO only)."""
    from meshlm.parallel import builtin_plans as plans  # noqa: F401  (registers the built-in families)

    for cls in type(model).__mro__:
        plan = _PLANS.get(cls) or _PLANS.get(cls.__name__)
        if plan is not None:
            return plan if isinstance(plan, ParallelPlan) else plan(model)
    return generic_plan(model)


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
