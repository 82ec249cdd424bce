"""Tensor parallel's build-time probe: `probe_tensor_parallel` computes for real, on the CPU, a few blocks of the
model on random weights, whole and split as a tensor-parallel plan says, to catch an entry that disagrees with its
weight's layout. It finds each block's inputs by a dry run on the meta device (meshlm.parallel.meta).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

from meshlm.parallel.meta import meta_forward
from meshlm.parallel.parallel_plan import (
    COLWISE,
    COLWISE_HEADS,
    FUSED_STYLES,
    ROWWISE,
    SEQUENCE_PARALLEL,
    FusedColwise,
    InterleavedColwise,
    ParallelPlan,
    PlanError,
    Style,
    tp_modules,
)
from meshlm.parallel.tp.rules import check_linear_style, linear_pieces

# ---- the tensor-parallel probe: each distinct planned block, split as the plan says vs whole ---------------------
# A tp plan entry says how a Linear's output rows are laid out; the model's forward is what actually splits them
# (chunk(3), a per-head view, slices at config widths). Nothing but running the forward can tell whether they
# agree, so before anything changes each distinct block that opens a tensor-parallel region (the nearest module
# around a column-style entry that holds the ROWWISE entry closing it) runs on CPU, in fp32, on random weights and
# on random stand-ins for its real inputs: once whole, then once per tp rank with that rank's slices
# (plan.linear_pieces, the cut the sharder makes). The sum over ranks of each ROWWISE output must be the whole
# run's. Every rank computes the same verdict from the same seeded numbers, without communicating.
PROBE_RTOL = 1e-3  # fp32 sums in another order differ by ~1e-6 relatively; a wrong row order by O(1)
PROBE_TOKENS = 4  # tokens of the probe batch (one row)
# A block whose column entries are all plain (COLWISE, COLWISE_HEADS) is probed only up to this many weight
# elements (~0.1 s of CPU): a fused entry is where a layout can silently disagree with its plan, and always probed.
PLAIN_PROBE_ELEMENTS = 1 << 22


class _Captured(Exception):
    """Stops the capturing forward once every probed block has seen its inputs."""


@dataclass(frozen=True)
class _Block:
    path: str  # the block's module name ("" never: a root-level region is not probed)
    entries: tuple[tuple[str, Style], ...]  # (module name, style) of every tp entry inside it, in order


def probe_tensor_parallel(model: nn.Module, plan: ParallelPlan, tp: int) -> None:
    """Refuse (one-line PlanError naming the module and its plan entry, and a style that would be exact if the
    probe finds one) a tp plan under which some block's forward differs from, or fails unlike, the whole
    block. A block whose inputs cannot be captured (a forward neither the meta device nor, for a real model, a
    short real batch runs) or whose whole run fails proves nothing and is skipped."""
    entries = [(name, style) for name, _, style in tp_modules(model, plan)]
    blocks = _distinct_blocks(model, entries)
    if not blocks:
        return
    with torch.random.fork_rng(devices=[]):  # a forward that draws (dropout) leaves the user's stream alone
        inputs = _capture_inputs(model, [b.path for b in blocks])
        gen = torch.Generator().manual_seed(0)
        for block in blocks:
            if block.path in inputs:
                _probe_block(model, plan, tp, block, inputs[block.path], gen)


def _is_column(style: Style) -> bool:
    return isinstance(style, FUSED_STYLES) or style in (COLWISE, COLWISE_HEADS)


def _distinct_blocks(model: nn.Module, entries: list[tuple[str, Style]]) -> list[_Block]:
    """The first block of each kind (class, its entries relative to it, its parameters' shapes): the layers of
    one model repeat a few kinds, so a 126-layer model probes about as many blocks as a 2-layer one."""
    rows = [name for name, style in entries if style == ROWWISE]
    seen, out = set(), []
    for name, style in entries:
        if not _is_column(style):
            continue
        parts = name.split(".")
        path = next(
            (
                p
                for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
                if any(r.startswith(p + ".") for r in rows)
            ),
            None,
        )
        if path is None:  # no ROWWISE closes it (a row-parallel layer declared colwise?): its parent, if any
            path = ".".join(parts[:-1])
            if not path:
                continue
        inside = tuple((n, s) for n, s in entries if n.startswith(path + "."))
        if any(not (_is_column(s) or s in (ROWWISE, SEQUENCE_PARALLEL)) for _, s in inside):
            continue  # an embedding, head or MoE layer inside: not a block of linears
        if sum(s == ROWWISE for _, s in inside) > 1:
            continue  # two regions in one block (a whole layer): the probe does not all-reduce between them
        module = model.get_submodule(path)
        fused = any(isinstance(s, FUSED_STYLES) for _, s in inside)
        if not fused and sum(p.numel() for p in module.parameters()) > PLAIN_PROBE_ELEMENTS:
            continue
        key = (
            type(module),
            tuple((n[len(path) :], s) for n, s in inside),
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
        )
        if key not in seen:
            seen.add(key)
            out.append(_Block(path, inside))
    return out


def _capture_inputs(model: nn.Module, paths: list[str]) -> dict[str, tuple[tuple, dict]]:
    """Each block's (args, kwargs) at its first call in a forward of the model: on the meta device (free), else,
    for a real model, on a short batch of real tokens (stopped as soon as all are seen)."""
    got: dict[str, tuple[tuple, dict]] = {}

    def hook(path: str) -> Callable:
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if path not in got:  # a copy: the rest of the forward may still change what they hold (a KV cache)
                got[path] = copy.deepcopy((args, kwargs))
            if len(got) == len(paths):
                raise _Captured

        return pre

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p), with_kwargs=True) for p in paths]
    try:
        tokens = torch.zeros((1, PROBE_TOKENS), dtype=torch.long, device="meta")
        meta_forward(model, tokens)
        real = next((p for p in model.parameters() if not p.is_meta), None)
        if len(got) < len(paths) and real is not None and not any(p.is_meta for p in model.parameters()):
            got.clear()
            buffers = {n: b.clone() for n, b in model.named_buffers()}  # running statistics stay the user's
            with torch.no_grad(), contextlib.suppress(Exception):  # proves nothing: the probe is skipped
                tokens = torch.zeros((1, PROBE_TOKENS), dtype=torch.long, device=real.device)
                functional_call(model, buffers, (tokens,), strict=False)
    finally:
        for h in handles:
            h.remove()
    return got


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A CPU stand-in for a captured input: floats random (fp32), real integers and masks kept, meta ones zero
    (positions) or True (masks)."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen)
    if t.is_meta:
        return torch.ones(t.shape, dtype=t.dtype) if t.dtype == torch.bool else torch.zeros(t.shape, dtype=t.dtype)
    return t.detach().cpu()


def _random_weights(block: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random fp32 CPU values for every parameter and buffer: matrices scaled by 1/√fan-in (activations O(1),
    softmax not saturated), vectors near 1 (norm gains) or 0 (biases); real integer buffers kept."""
    out = {}
    for name, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]:
        if not t.is_floating_point():
            out[name] = _random_like(t, gen)
        elif t.ndim >= 2:
            out[name] = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1])
        else:
            base = 1.0 if name.rpartition(".")[2] in ("weight", "gain", "scale") else 0.0
            out[name] = base + 0.1 * torch.randn(t.shape, generator=gen)
    return out


def _rank_weights(
    model: nn.Module,
    plan: ParallelPlan,
    tp: int,
    rank: int,
    block: _Block,
    styles: dict[str, Style],
    whole: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The block's weights as tp rank `rank` holds them: every column entry's rows (weight, bias, LoRA B), every
    ROWWISE entry's columns (weight, LoRA A) with no bias (added once, after the sum over ranks)."""
    out = dict(whole)
    for name, _ in block.entries:
        style = styles[name]
        if style == SEQUENCE_PARALLEL:
            continue
        module = model.get_submodule(name)
        dim, pieces = linear_pieces(plan, model, name, module, style, tp, rank)
        rel = name[len(block.path) + 1 :]
        cut = {"weight": dim, "bias": 0, "lora_B": 0} if dim == 0 else {"weight": 1, "lora_A": 1}
        for pname, d in cut.items():
            key = f"{rel}.{pname}"
            if key in out:
                out[key] = torch.cat([out[key].narrow(d, s, n) for s, n in pieces], d)
        if style == ROWWISE and f"{rel}.bias" in out:
            out[f"{rel}.bias"] = torch.zeros_like(out[f"{rel}.bias"])
    return out


def _run_block(
    module: nn.Module, weights: dict[str, torch.Tensor], inputs: tuple[tuple, dict], rows: list[nn.Module]
) -> list[tuple[nn.Module, torch.Tensor]]:
    """The ROWWISE modules' outputs, in call order, of one eval-mode forward of `module` with `weights`."""
    outs: list[tuple[nn.Module, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda m, _, y: outs.append((m, y))) for m in rows]
    modes = {m: m.training for m in module.modules()}
    module.eval()  # dropout would differ between the whole and the split runs
    try:
        with torch.no_grad():
            args, kwargs = copy.deepcopy(inputs)  # a fresh copy of any state an input holds (a KV cache)
            functional_call(module, weights, args, kwargs, tie_weights=True, strict=False)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return outs


def _split_differs(
    model: nn.Module,
    plan: ParallelPlan,
    tp: int,
    block: _Block,
    styles: dict[str, Style],
    whole: dict[str, torch.Tensor],
    inputs: tuple[tuple, dict],
    reference: list[tuple[nn.Module, torch.Tensor]] | None = None,
) -> str | None:
    """'' if the ranks' ROWWISE outputs (under `styles`) sum to the whole run's (`reference`, computed if not
    given), else what differs (or what a rank raised); None if it runs but there is no ROWWISE output to compare."""
    module = model.get_submodule(block.path)
    rows = [model.get_submodule(n) for n, s in styles.items() if s == ROWWISE]
    if reference is None:
        reference = _run_block(module, whole, inputs, rows)
    total = None
    for rank in range(tp):
        try:
            outs = _run_block(module, _rank_weights(model, plan, tp, rank, block, styles, whole), inputs, rows)
        except PlanError:
            raise
        except Exception as e:  # the split forward fails: so would the real one, at step 1
            return f"its forward fails when split ({type(e).__name__}: {_first_line(e)})"
        if [m for m, _ in outs] != [m for m, _ in reference] or any(
            y.shape != r.shape for (_, y), (_, r) in zip(outs, reference, strict=True)
        ):
            return "its split forward calls the ROWWISE layers differently or gives other shapes"
        total = [y for _, y in outs] if total is None else [t + y for t, (_, y) in zip(total, outs, strict=True)]
    worst = 0.0
    for (m, ref), got in zip(reference, total or [], strict=True):
        bias = getattr(m, "bias", None)
        if bias is not None:
            got = got + whole[f"{_rel(model, block, m)}.bias"]
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    if worst > PROBE_RTOL:
        return f"the split output differs from the whole block's by {worst:.1e} relatively"
    return "" if reference else None


def _rel(model: nn.Module, block: _Block, module: nn.Module) -> str:
    return next(n for n, m in model.get_submodule(block.path).named_modules() if m is module)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:160]


def _probe_block(
    model: nn.Module, plan: ParallelPlan, tp: int, block: _Block, captured: tuple[tuple, dict], gen: torch.Generator
) -> None:
    module = model.get_submodule(block.path)
    whole = _random_weights(module, gen)
    inputs = tree_map(lambda t: _random_like(t, gen) if isinstance(t, torch.Tensor) else t, captured)
    rows = [model.get_submodule(n) for n, s in block.entries if s == ROWWISE]
    try:
        reference = _run_block(module, whole, inputs, rows)
        again = _run_block(module, whole, inputs, rows)
    except Exception:  # the whole block does not run on stand-in inputs: nothing to compare
        return
    if any(not torch.equal(a, b) for (_, a), (_, b) in zip(reference, again, strict=True)):
        return  # a forward that is not a function of its inputs and weights (it draws): nothing to compare
    styles = dict(block.entries)
    what = _split_differs(model, plan, tp, block, styles, whole, inputs, reference)
    if not what:
        return
    columns = [(n, s) for n, s in block.entries if _is_column(s) or s == ROWWISE]
    for name, style in columns:  # which entry: the first whose change to another style makes the block exact
        for other in _alternatives(model, plan, name, style, tp):
            if _split_differs(model, plan, tp, block, {**styles, name: other}, whole, inputs) == "":
                raise PlanError(
                    f"plan {plan.name!r}: module {name} ({style}) does not match its weight's row order at tp={tp}: "
                    f"in a build-time probe of {block.path} {what}; valid: {other} (exact in the same probe)"
                )
    named = ", ".join(f"{n}: {s}" for n, s in columns)
    raise PlanError(
        f"plan {plan.name!r}: block {block.path} split at tp={tp} as {named} is not the whole block: in a "
        f"build-time probe {what}, and no other style of one entry is exact; its forward must read widths from "
        "its tensors (docs/api.md, plan rules), or leave its linears out of tensor_parallel"
    )


def _alternatives(model: nn.Module, plan: ParallelPlan, name: str, style: Style, tp: int) -> list[Style]:
    """The Linear styles that fit module `name` at tp (check_linear_style accepts them), `style` excluded:
    per-head, Q/K/V of the model's query and KV head counts (grouped-query attention), 3 or 2 equal blocks,
    plain colwise, colwise at head boundaries, rowwise."""
    candidates: list[Style] = []
    if plan.head_dim is not None:  # the per-head styles first: they say more than a plain split that agrees
        candidates += [InterleavedColwise(3), FusedColwise(3, heads=True)]
        heads = _head_counts(model.get_submodule(name.rpartition(".")[0])) or _head_counts(model)
        if heads is not None:
            head_dim = plan.head_dim(model)
            widths = (heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim)
            candidates.append(FusedColwise(widths, heads=True))
    candidates += [FusedColwise(3), FusedColwise(2), COLWISE]
    if plan.head_dim is not None:
        candidates.append(COLWISE_HEADS)  # after COLWISE: it only differs from it where KV heads are replicated
    candidates.append(ROWWISE)
    module = model.get_submodule(name)
    out = []
    for candidate in candidates:
        if candidate == style:
            continue
        try:
            check_linear_style(plan, model, name, module, candidate, tp)
        except PlanError:
            continue
        out.append(candidate)
    return out


def _head_counts(model: nn.Module) -> tuple[int, int] | None:
    """(query heads, KV heads) from a module's config (Hugging Face's or meshlm's), if it says."""
    for config, q, kv in ((getattr(model, "config", None), "num_attention_heads", "num_key_value_heads"),
                          (getattr(model, "cfg", None), "n_heads", "n_kv_heads")):  # fmt: skip
        heads = getattr(config, q, None)
        if isinstance(heads, int):
            kv_heads = getattr(config, kv, None)
            return heads, kv_heads if isinstance(kv_heads, int) else heads
    return None
