"""Localisation of a failed check: the module responsible for the first step that differs, its plan entry and
placement, and the layout dimension without which it is exact (docs/check.md, "On a failure, localisation").

From one step's unclipped gradients at world 1 and at the layout (meshlm.check.worker's 'grads' mode: the
weights after the step are the gradients), each module's input and output of that step's first micro-batch,
and the global gradient norm: `blame` says which module, `localise` runs the gradient jobs and writes the
report's culprit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshlm.check.run import (
    GRAD_RTOL,
    LOSS_RTOL,
    SINGLE_PROCESS,
    CheckError,
    CheckReport,
    Row,
    rel,
    run_config,
    without,
    world_of,
)
from meshlm.config import Config
from meshlm.parallel.mesh import DIMS, parse_layout


def grads_differ(got: dict, ref: dict) -> list[tuple[str, float]]:
    """(name, rel) of each gradient that differs, in the reference model's order (forward order): the gathered
    full one or any rank's own copy of one it holds whole."""
    out = []
    for name, r in ref.items():
        held = [got["weights"][name], *(copies[name] for copies in got["copies"] if name in copies)]
        d = max(((g - r).norm() / r.norm().clamp(min=1e-30)).item() for g in held)
        if d > GRAD_RTOL:
            out.append((name, d))
    return out


def entry_point(differ: list[tuple[str, float]], names: list[str]) -> str | None:
    """The parameter at whose module a wrong activation gradient entered the backward pass, if the differing
    gradients say so: backward runs from the loss to the embedding, so such a gradient makes every parameter
    before that module (in forward order) differ and the module's own agree. That is the case when the
    differing ones are exactly the first ones, spanning two modules at least, and some agree after them;
    otherwise (one parameter's own reduction wrong: a plan entry, a bucket) there is none."""
    n = len(differ)
    if n == len(names) or [name for name, _ in differ] != names[:n]:
        return None
    modules = {name.rsplit(".", 1)[0] for name in names[:n]}
    return names[n] if len(modules) > 1 else None


def common_scale(got: dict, ref: dict) -> float | None:
    """The one factor c with got = c·ref for every gradient (each within GRAD_RTOL of c·ref, norm-wise), if there
    is one: a gradient reduction applied twice (c = the group's size) or a mean taken twice (c = 1/size) scales
    every gradient alike, while the forward pass and the loss agree."""
    num = sum((got[name] * r).sum().item() for name, r in ref.items())
    den = sum(r.square().sum().item() for r in ref.values())
    c = num / max(den, 1e-30)
    fits = all(
        ((got[name] - c * r).norm() / (c * r).norm().clamp(min=1e-30)).item() <= GRAD_RTOL for name, r in ref.items()
    )
    return c if fits and abs(c - 1) > GRAD_RTOL else None


def counted_wrongly(got_norm: float, ref_norm: float, grads: dict) -> tuple[str, str] | None:
    """The tensor whose norm term the layout counts twice or never, when the gradients agree and their global
    norm does not: the squared norms differ by that tensor's ‖g‖² (within the 1e-5 rel of either norm)."""
    excess, tol = got_norm**2 - ref_norm**2, 2 * GRAD_RTOL * ref_norm**2
    fits = [
        (abs(excess - sign * g.square().sum().item()), name, how)
        for name, g in grads.items()
        for sign, how in ((1, "counted twice"), (-1, "never counted"))
    ]
    miss, name, how = min(fits, key=lambda fit: fit[0])  # the first in forward order of equal fits (a tie)
    return (name, how) if miss <= tol else None


def assembled(records: list[dict], shape: tuple[int, ...], key: str) -> list[torch.Tensor]:
    """The copies of a module's input or output (`key`) the layout's ranks hold as one process would: each rank's
    whole copy of that shape, and the one the tp ranks' column shards make together, each shard placed where
    its plan's pieces say (Shard.pieces of the Linear's weight; a shard of another kind, such as a sequence
    shard, has another shape and is left out)."""
    held, full, covered = [], None, None
    for record in records:
        t, pieces = record[key], record[f"{key}_shard"]
        if t is None:
            continue
        if pieces is None:
            held += [t] if tuple(t.shape) == tuple(shape) else []
            continue
        if tuple(t.shape[:-1]) != tuple(shape[:-1]) or max(start + size for start, size in pieces) > shape[-1]:
            continue
        if full is None:
            full, covered = torch.zeros(shape, dtype=t.dtype), torch.zeros(shape[-1], dtype=torch.bool)
        at = 0
        for start, size in pieces:
            full[..., start : start + size] = t[..., at : at + size]
            covered[start : start + size] = True
            at += size
    return held + ([full] if covered is not None and bool(covered.all()) else [])


def worst(held: list[torch.Tensor], r: torch.Tensor) -> float:
    return max(
        (((h.double() - r.double()).norm() / r.double().norm().clamp(min=1e-30)).item() for h in held), default=0.0
    )


def first_module_differs(got: dict, ref: dict) -> tuple[str, float, str] | None:
    """The first module, in the order the reference's calls end (a module's children before it), whose output
    of the first micro-batch differs, gathered over its tp shards as its plan entry places them, on a rank of
    the first replica (the same rows): (the module to name, by how much, why). If its own input agrees (or is
    not comparable) the module itself computes wrongly. If its input differs although every module before it
    agrees, the difference arose in its parent's own code between them, which runs on each rank's columns of
    the last tp-sharded output before it in that parent (a colwise entry): that entry's layout disagrees with
    the code that consumes it (a blocked [Q|K|V] declared per head, a plain projection declared fused), so
    that entry is named."""
    [mine] = ref["outputs"]
    order = list(mine["modules"])
    for i, name in enumerate(order):
        r = mine["modules"][name]
        if r["out"].ndim < 3 or tuple(r["out"].shape[:2]) != mine["tokens"]:  # not one row-and-position tensor
            continue
        records = [out["modules"][name] for out in got["outputs"] if name in out["modules"]]
        d = worst(assembled(records, tuple(r["out"].shape), "out"), r["out"])
        if d <= GRAD_RTOL:
            continue
        given = assembled(records, tuple(r["in"].shape), "in") if r["in"] is not None else []
        if not given or worst(given, r["in"]) <= GRAD_RTOL:
            return name, d, f"output differs {d:.1e} rel on the same input"
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        sharded = [
            n
            for n in order[:i]
            if n.startswith(f"{parent}.")
            and any(rec["out_shard"] for out in got["outputs"] for rec in [out["modules"].get(n)] if rec)
        ]
        if sharded:
            return (
                sharded[-1],
                d,
                (
                    f"its output agrees gathered, but {parent}'s code on each rank's columns of it gives {name} "
                    f"an input that differs ({name}'s output {d:.1e} rel): this entry's column order is not the "
                    "one that code reads"
                ),
            )
        return name, d, f"output differs {d:.1e} rel (its input too: {parent or 'the model'}'s code before it)"
    return None


def blame(got: dict, ref: dict, step: int) -> tuple[str, str, str, float] | str:
    """(module, the tensor whose placement goes with it, what differs, by how much) from one step's gradients,
    norm and module outputs at the layout (`got`) and at world 1 (`ref`; its frozen weights left out), or the
    line that says why no module can be named.

    The module: where a wrong activation gradient entered backward (entry_point) if the differing gradients
    show one, else the first tensor in forward order whose gradient differs; when every gradient agrees and
    their global norm does not, the tensor whose norm term is counted twice or never (counted_wrongly); when
    every gradient differs by one factor and the loss agrees, the reduction they share (common_scale); when
    they differ otherwise, the forward pass does: the first module whose output differs
    (first_module_differs)."""
    names, differ = list(ref["weights"]), grads_differ(got, ref["weights"])
    d_norm = rel(got["grad_norms"][0], ref["grad_norms"][0])
    d_first = rel(got["losses"][0], ref["losses"][0])
    if len(differ) == len(names) and d_first <= LOSS_RTOL and (scale := common_scale(got["weights"], ref["weights"])):
        (name, d), module = differ[0], "every tensor"
        what = (
            f"grad is {scale:.4g}x one process's (step-{step} loss agrees, {d_first:.1e} rel): the gradient "
            "reduction shared by every tensor is applied twice or its mean taken twice or never"
        )
    elif len(differ) == len(names) and (output := first_module_differs(got, ref)):
        (module, d, why), name = output, next((n for n in names if n.startswith(output[0] + ".")), differ[0][0])
        what = (
            f"{why}; the first module in forward order to differ (every gradient differs, step-{step} loss "
            f"{d_first:.1e} rel)"
        )
    elif len(differ) == len(names):  # no one module: the forward (or the loss) already differs
        (name, d) = differ[0]
        module = "every tensor"
        what = f"grad differs (from {name} {d:.1e} rel; step-{step} loss {d_first:.1e} rel): the forward pass differs"
    elif differ:
        entry = entry_point(differ, names)
        name, d = (entry, differ[0][1]) if entry else differ[0]
        module = name.rsplit(".", 1)[0]
        what = (
            f"its input gradient differs (every gradient before it in forward order differs, from {differ[0][0]} "
            f"{d:.1e} rel; its own agree)"
            if entry
            else f"grad differs {d:.1e} rel"
        )
    elif d_norm > LOSS_RTOL and (wrong := counted_wrongly(got["grad_norms"][0], ref["grad_norms"][0], ref["weights"])):
        (name, how), d = wrong, d_norm
        module = name.rsplit(".", 1)[0]
        what = f"gradients agree, their global norm differs {d_norm:.1e} rel: {name} {how} in it (Placement.counted)"
    else:
        return (
            f"step-{step} gradients agree on every rank, their global norm differs {d_norm:.1e} rel (no one "
            "tensor's term accounts for it)"
            if d_norm > LOSS_RTOL
            else f"step-{step} gradients and norm agree: the difference arises in a later step (an optimizer's "
            "state, the resume)"
        )
    return module, name, what, d


def localise(
    cfg: Config, batches: list, workdir: Path, report: CheckReport, parts: dict | None, timed, step: int = 1
) -> None:
    """The full gradients (unclipped) of `step`, the first step whose loss or gradient norm differs (else 1),
    at the layout against world 1, both from the reference's weights and optimizer state before that step (its
    checkpoint): the module responsible, where its tensor lives, and the layout dimension whose removal makes
    every gradient and their norm exact (the module: blame)."""
    layout = cfg.parallel.layout
    data = cfg.model_dump()
    data["train"]["grad_clip"] = 0.0
    plain = Config.model_validate(data)
    start = (workdir / "reference", step - 1)
    label = f"step-{step} gradients"

    def grads(phase: str, name: str, layout: str, **options: object) -> tuple[dict, float]:
        g_cfg = run_config(plain, workdir / name, layout, step, **options)
        return timed(
            f"{label} at {phase}", g_cfg, world_of(layout), batches, workdir, name, "grads", parts, start=start
        )

    ref, _ = grads("world 1", "grads-reference", "", **SINGLE_PROCESS)
    reference_run = dict(ref)  # as the run returned it: what a run of the same job returns
    got, t = grads("the layout", "grads", layout)
    ref["weights"] = {name: g for name, g in ref["weights"].items() if name not in ref["frozen"]}  # no gradient

    def exact(run: dict) -> bool:
        return not grads_differ(run, ref["weights"]) and rel(run["grad_norms"][0], ref["grad_norms"][0]) <= LOSS_RTOL

    found = blame(got, ref, step)
    if isinstance(found, str):
        report.culprit = found
        return
    module, name, what, d = found
    d_norm = rel(got["grad_norms"][0], ref["grad_norms"][0])
    entry = got["entries"].get(module)
    culprit = f"{module}: {what}; " + (f"{entry}; " if entry else "") + got["placements"].get(name, "")
    if step > 1:
        culprit += f"; first at step {step}"
    for dim in DIMS:
        if f"{dim}=" not in layout or f"{dim}=1" in layout.split(","):
            continue
        smaller, options = without(plain, dim)
        if same_job(plain, smaller, options, step):  # e.g. tp=2 without tp: the reference's own job, run above
            res = reference_run
        else:
            try:
                res, _ = grads(smaller, f"grads-no-{dim}", smaller, **options)
            except CheckError:
                continue
        if exact(res):
            culprit += f"; exact with {dim}=1" + (f" ({smaller})" if world_of(smaller) > 1 else "")
            break
    report.culprit = culprit
    report.rows.append(Row(f"{label} per tensor", None, d_norm, d, f"<= {GRAD_RTOL:g} per tensor", t, False))


def same_job(plain: Config, layout: str, options: dict, step: int) -> bool:
    """Whether the gradient run at `layout` with `options` is the world-1 reference's job: the same config but
    for the run directory and the spelling of a layout of ones ("tp=1" or ""). A check run is deterministic
    (float64, one thread per rank, the same inputs), so its result is the reference's, and the run is not started
    again: a failing check of a one-dimension layout is one world-1 run shorter."""

    def job(layout: str, **options: object) -> dict:
        data = run_config(plain, Path("."), layout, step, **options).model_dump()
        data["parallel"]["layout"] = parse_layout(data["parallel"]["layout"], 1) if world_of(layout) == 1 else layout
        return data

    return world_of(layout) == 1 and job(layout, **options) == job("", **SINGLE_PROCESS)
