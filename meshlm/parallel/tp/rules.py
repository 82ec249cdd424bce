"""Tensor parallel's plan rules: the plan's tensor_parallel table checked against a model at a tp size (every
pattern matches, every style fits its module, ties are sharded alike), and the cut each style makes
(`linear_pieces`, `fused_widths`, `moe_split_params`), which the sharder (meshlm.parallel.tp.sharding) and the
build-time probe (meshlm.parallel.tp.probe) both use."""

from __future__ import annotations

import fnmatch

from torch import nn

from meshlm.model.lora import LoRALinear
from meshlm.model.moe import MoE
from meshlm.parallel.parallel_plan import (
    COLWISE,
    COLWISE_HEADS,
    FUSED_STYLES,
    LINEAR_STYLES,
    ROWWISE,
    TP_STYLES,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    FusedColwise,
    InterleavedColwise,
    ParallelPlan,
    PlanError,
    SplitMoE,
    Style,
    module_examples,
    tp_modules,
)


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
                f"(modules: {module_examples(names)})"
            )
    for name, module, style in tp_modules(model, plan):
        check_linear_style(plan, model, name, module, style, tp)
    _check_tp_ties(model, plan, tp)
    if plan.check is not None:
        plan.check(model, tp)


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
