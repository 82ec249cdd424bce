"""Run a replica at world 1 and at its layout, each by the real trainer under torchrun on gloo, and compare.

Every check run computes in float64 (meshlm.check.worker sets the ranks' default dtype; DataParallel keeps
float64 masters, shards and reductions for float64 parameters). A parameter whose gradient is zero in exact
arithmetic (an attention key bias: softmax is invariant to it) gets rounding noise whose sign depends on the
summation order; in float32 that noise (~1e-10) exceeds AdamW's eps once normalised by its own RMS, so AdamW
moved it by lr-sized steps in random directions and correct layouts failed (5e-5..2.5e-4 on final weights).
In float64 it is ~1e-19, far below eps: it stays put in every run, under any optimizer.
Tolerances (as the equivalence suite, tests/equivalence.py): a loss is a mean over the global batch's tokens
and a gradient norm a sum of squares, logged in float32: reordering changes them by ~1e-7 relative, so every
step's loss and norm must agree within 1e-5; a wrong reduction changes a gradient by O(1) and the next
step's loss by far more. The final weights are compared norm-wise per tensor, against the larger of its norm
and the model's RMS weight over as many elements (a tensor at ~0 measured at the model's scale), within the
same 1e-5; a bug moves whole tensors by lr-sized steps. A checkpoint reshards bytes, so the resumed run must
continue the reference's steps within the same 1e-5. The localisation's gradients (of the first step that
differs) and module inputs and outputs are compared per tensor within 1e-5 (same reason as the loss).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlm.checkpoint.store import list_checkpoints
from meshlm.config import Config
from meshlm.errors import InputError
from meshlm.parallel.mesh import DIMS

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
GRAD_RTOL = 1e-5
WHY = {
    "loss": "fp32: reduction order moves a mean by ~1e-7 rel; a bug by O(1e-2)",
    "weights": "norm-wise per tensor, float64 runs: rounding never reaches an optimizer's eps",
}


class CheckError(InputError):
    """A check that cannot run (a replica too wide for the machine, a run that failed to start)."""


class RaisedInModule(CheckError):
    """A check run whose rank raised in a module's forward (a shape error): `where` names the module, its plan
    entry and the error (meshlm.check.worker.where_raised)."""

    def __init__(self, line: str, where: str, error: str) -> None:
        super().__init__(line)
        self.where, self.error = where, error


@dataclass
class Row:
    check: str
    d_loss: float | None
    d_grad_norm: float | None
    d_weights: float | None
    tolerance: str
    seconds: float
    passed: bool
    note: str = ""
    d_logits: float | None = None


@dataclass
class CheckReport:
    layout: str
    rows: list[Row] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    culprit: str = ""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def as_dict(self) -> dict:
        """The report as JSON-able data: what `meshlm check --json` prints, less the replica's lines."""
        return {
            "layout": self.layout,
            "passed": self.passed,
            "checks": [r.__dict__ for r in self.rows],
            "phases_s": self.phases,
            "culprit": self.culprit,
        }

    def to_json(self) -> str:
        """as_dict() as JSON text."""
        return json.dumps(self.as_dict())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def max_rel(got: list[float], ref: list[float]) -> float:
    return max((rel(a, b) for a, b in zip(got, ref, strict=True)), default=0.0)


def weights_rel(got: dict, ref: dict) -> tuple[float, str]:
    """max over tensors of ‖got - ref‖ / ‖ref‖, and the first tensor (forward order) beyond WEIGHT_RTOL. A tensor
    whose norm is below the model's (a zero-initialised bias that gets no gradient stays ~1e-12 in float64) is
    measured against the model's RMS weight over as many elements: a bug moves it by lr-sized steps, orders of
    magnitude above WEIGHT_RTOL of that scale."""
    total = sum(r.double().square().sum().item() for r in ref.values())
    rms = (total / max(1, sum(r.numel() for r in ref.values()))) ** 0.5
    worst, first = 0.0, ""
    for name, r in ref.items():
        scale = max(r.double().norm().item(), rms * r.numel() ** 0.5, 1e-30)
        d = (got[name].double() - r.double()).norm().item() / scale
        worst = max(worst, d)
        if d > WEIGHT_RTOL and not first:
            first = f"first tensor whose final weights differ: {name} ({d:.1e} rel)"
    return worst, first


def run_job(
    cfg: Config,
    world: int,
    batches: list,
    workdir: Path,
    name: str,
    mode: str = "train",
    parts: dict | None = None,
    timeout: float = 900,
    start: tuple[Path, int] | None = None,
) -> dict:
    """`meshlm.fit(cfg)` on `world` gloo ranks under torchrun; rank 0's result (meshlm.check.worker). `start`
    (run directory, step): the run resumes that run's checkpoint of that step (0: none, a fresh start)."""
    job, out = workdir / f"{name}.job", workdir / f"{name}.out"
    parts = {key: by_name(value) for key, value in (parts or {}).items()}
    if mode != "resume":  # a run directory left by an earlier check would be resumed
        shutil.rmtree(cfg.log.run_dir, ignore_errors=True)
    if start and start[1]:
        copy_until(start[0], Path(cfg.log.run_dir), start[1])
    for stale in [
        out,
        *workdir.glob(f"{out.name}.refused-*"),
        *workdir.glob(f"{out.name}.raised-*"),
    ]:  # an earlier check's result is not this one's
        stale.unlink(missing_ok=True)
    for key, value in parts.items():
        try:
            pickle.dumps(value)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise CheckError(
                f"{key} {getattr(value, '__qualname__', None) or getattr(value, 'name', type(value).__name__)!r} "
                f"cannot reach the check's ranks ({e}): they import the model factory, plan and "
                "loss by name, so define them at module level (in a module or your script), not inside a "
                "function (docs/check.md)"
            ) from None
    job.write_bytes(pickle.dumps({"config": cfg, "batches": batches, "parts": parts, "mode": mode, "out": str(out)}))
    path = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())  # the ranks import what the caller does
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "meshlm.check.worker",
        str(job),
    ]
    log = workdir / f"{name}.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    refused = sorted(workdir.glob(f"{out.name}.refused-*"), key=lambda path: int(path.name.rsplit("-", 1)[1]))
    if refused:  # bad input the ranks met (a plan, a layout): the lowest rank's one line, without a rank prefix
        raise CheckError(f"check run {name} ({cfg.parallel.layout or 'world 1'}) refused: {refused[0].read_text()}")
    raised = sorted(workdir.glob(f"{out.name}.raised-*"), key=lambda path: int(path.name.rsplit("-", 1)[1]))
    if done.returncode and raised:  # the lowest rank's module, plan entry and error
        where, error = raised[0].read_text().split("\t", 1)
        line = f"check run {name} ({cfg.parallel.layout or 'world 1'}) raised in {where}: {error}"
        raise RaisedInModule(line, where, error)
    if done.returncode or not out.exists():
        reason = failure_reason(log.read_text()) if done.returncode else "exited 0 without its result"
        raise CheckError(f"check run {name} ({cfg.parallel.layout or 'world 1'}) failed: {reason} (log {log})")
    return pickle.loads(out.read_bytes())


def failure_reason(log: str) -> str:
    """Why a torchrun job failed, from its log: the last Python exception line a rank printed; else, for a rank
    killed by a signal (a C++ abort, a segfault), torchrun's root cause ("rank 0 died of SIGABRT") with the
    last fatal line before it ("terminate called ...", "Fatal Python error: ..."; each rank's Python stacks
    follow it in the log: meshlm.check.worker enables faulthandler)."""
    lines = log.splitlines()
    errors = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]
    if errors:
        return errors[-1]
    cause = "\n".join(lines[next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), len(lines)) :])
    rank = re.search(r"rank\s*: (\d+)", cause)
    signal = re.search(r"Signal \d+ \((SIG\w+)\)", cause)
    if not (rank and signal):
        return "no output"
    fatal = [line.strip() for line in lines if line.startswith(("terminate called", "Fatal Python error"))]
    return f"rank {rank[1]} died of {signal[1]}" + (f" ({fatal[0]})" if fatal else "")


def copy_until(run_dir: Path, to: Path, step: int) -> None:
    """A copy of `run_dir` whose newest checkpoint is the one of `step` (a run there resumes from it)."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(run_dir, to)
    for path in list_checkpoints(to):
        if int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)


def by_name(value: object) -> object:
    """A user's piece as (module, name) when a module holds it under a name (a plan of lambdas cannot be pickled
    by value), or as (script path, name) when the caller's script does; the ranks import it
    (meshlm.check.worker.resolve). Anything else is pickled as it is."""
    if value is None or isinstance(value, bool):
        return value
    home = getattr(value, "__module__", None)
    candidates = [(home, sys.modules.get(home))] if isinstance(home, str) else []
    for module_name, module in candidates + list(sys.modules.items()):
        if module_name in ("__main__", "__mp_main__") or module is None:
            continue
        for attr, held in list(vars(module).items()):
            if held is value:
                return ("meshlm.check:by-name", module_name, attr)
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None):  # the ranks load the script under another name: its main part stays idle
        for attr, held in list(vars(main).items()):
            if held is value:
                return ("meshlm.check:by-path", str(Path(main.__file__).resolve()), attr)
    return value


def run_config(cfg: Config, run_dir: Path, layout: str, steps: int, every: int = 0, **parallel: object) -> Config:
    """The replica's config for one check run: its own run directory, a metric line each step, a checkpoint
    every `every` steps (0: halfway), nothing else."""
    data = cfg.model_dump()
    data["parallel"].update(layout=layout, **parallel)
    data["train"].update(steps=steps, eval_every=0, device="cpu")
    data["log"].update(
        run_dir=str(run_dir),
        every=1,
        tensorboard=False,
        progress=False,
        aggregate_every=0,
        wandb_project="",
        mlflow_experiment="",
    )
    data["checkpoint"].update(every=every or max(1, steps // 2), keep=steps + 1, async_save=False, resume=True)
    data["fault"].update(desync_every=0)
    return Config.model_validate(data)


# The [parallel] of one process: no layout, no ZeRO, no schedule options.
SINGLE_PROCESS = {"zero": 0, "zero_shard_size": None, "sequence_parallel": False, "virtual_stages": 1}


def without(cfg: Config, dim: str) -> tuple[str, dict]:
    """The layout with `dim` set to 1, and the options that need that dimension dropped."""
    sizes = {d: v for d, v in (part.split("=") for part in cfg.parallel.layout.split(",") if part)}
    sizes[dim] = "1"
    options: dict = {}
    if dim == "pp":
        options["virtual_stages"] = 1
    if dim == "tp":
        options["sequence_parallel"] = False
    if dim == "dp":
        options.update(zero=0, zero_shard_size=None)
    return ",".join(f"{d}={v}" for d, v in sizes.items()), options


def world_of(layout: str) -> int:
    sizes = dict(part.split("=") for part in layout.split(",") if part)
    n = 1
    for dim in DIMS:
        n *= int(sizes.get(dim, 1))
    return n


def check(cfg: Config, batches: list, workdir: Path, *, steps: int = 5, parts: dict | None = None,
          export: bool = False, say=lambda line: None) -> CheckReport:  # fmt: skip
    """Train `cfg` (a replica: CPU, fp32, an explicit layout) for `steps` steps at world 1 and at its layout on
    `batches`, resume the layout's middle checkpoint at world 1, with `export` (meshlm's model, no user parts)
    export the layout's final checkpoint to HF and back (meshlm.check.export), and localise a difference."""
    layout = cfg.parallel.layout
    world = world_of(layout)
    report = CheckReport(layout=layout)
    workdir.mkdir(parents=True, exist_ok=True)

    def timed(phase: str, *job: object, **kw: object) -> tuple[dict, float]:
        say(f"{phase} ...")
        start = time.monotonic()
        try:
            value = run_job(*job, **kw)
        finally:
            report.phases[phase] = round(time.monotonic() - start, 2)
        return value, report.phases[phase]

    lay_cfg = run_config(cfg, workdir / "layout", layout, steps)  # first: what the layout refuses, it refuses at once
    try:
        got, t_lay = timed(f"layout {layout} ({world} ranks)", lay_cfg, world, batches, workdir, "layout", parts=parts)
    except RaisedInModule as e:  # a plan entry that cannot run (a shape error): that module is the culprit
        seconds = report.phases[f"layout {layout} ({world} ranks)"]
        row = Row(f"{steps} steps at {layout} vs world 1", None, None, None, "runs", seconds, False, str(e))
        report.rows.append(row)
        report.culprit = f"{e.where}: raised at the layout, {e.error}"
        return report
    ref_cfg = run_config(cfg, workdir / "reference", "", steps, every=1, **SINGLE_PROCESS)  # each: localise's
    ref, t_ref = timed("reference (world 1)", ref_cfg, 1, batches, workdir, "reference", parts=parts)
    d_loss, d_norm = max_rel(got["losses"], ref["losses"]), max_rel(got["grad_norms"], ref["grad_norms"])
    d_w, first = weights_rel(got["weights"], ref["weights"])
    report.rows.append(
        Row(
            f"{steps} steps at {layout} vs world 1",
            d_loss,
            d_norm,
            d_w,
            f"loss, norm <= {LOSS_RTOL:g} ({WHY['loss']}); weights <= {WEIGHT_RTOL:g} ({WHY['weights']})",
            t_ref + t_lay,
            d_loss <= LOSS_RTOL and d_norm <= LOSS_RTOL and d_w <= WEIGHT_RTOL,
            first,
        )
    )

    saved = list_checkpoints(workdir / "layout")
    middle = max(1, steps // 2)
    if saved and report.passed:  # a checkpoint of a run that already differs proves nothing more
        resume_dir = workdir / "resumed"
        copy_until(workdir / "layout", resume_dir, middle)
        res_cfg = run_config(cfg, resume_dir, "", steps, **SINGLE_PROCESS)
        res, t_res = timed(f"resume step {middle} at world 1", res_cfg, 1, batches, workdir, "resumed", "resume", parts)
        ref_tail = dict(zip(ref["steps"], ref["losses"], strict=True))
        ref_norms = dict(zip(ref["steps"], ref["grad_norms"], strict=True))
        d_loss = max_rel(res["losses"], [ref_tail[s] for s in res["steps"]])
        d_norm = max_rel(res["grad_norms"], [ref_norms[s] for s in res["steps"]])
        d_w, first = weights_rel(res["weights"], ref["weights"])
        report.rows.append(
            Row(
                f"save at {layout} step {middle}, resume at world 1",
                d_loss,
                d_norm,
                d_w,
                "as above: loading reshards bytes, no arithmetic",
                t_res,
                d_loss <= LOSS_RTOL and d_norm <= LOSS_RTOL and d_w <= WEIGHT_RTOL,
                first,
            )
        )
    if export and report.passed:  # an export of weights that already differ would fail for that reason
        from meshlm.check.export import add_export_rows

        add_export_rows(cfg, workdir, batches[0][0], report, say)
    if not report.passed:
        pairs = zip(got["losses"], ref["losses"], got["grad_norms"], ref["grad_norms"], strict=True)
        differs = [
            s for s, (a, b, n, m) in zip(ref["steps"], pairs, strict=True) if max(rel(a, b), rel(n, m)) > LOSS_RTOL
        ]
        localise(cfg, batches, workdir, report, parts, timed, differs[0] if differs else 1)
    return report


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
    its plan's pieces say (TPShard.pieces of the Linear's weight; a shard of another kind, such as a sequence
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
        try:
            res, _ = grads(smaller, f"grads-no-{dim}", smaller, **options)
        except CheckError:
            continue
        if exact(res):
            culprit += f"; exact with {dim}=1" + (f" ({smaller})" if world_of(smaller) > 1 else "")
            break
    report.culprit = culprit
    report.rows.append(Row(f"{label} per tensor", None, d_norm, d, f"<= {GRAD_RTOL:g} per tensor", t, False))


def map_ids(batches: list, vocab_size: int, ignore_index: int) -> list:
    """Token ids folded into the replica's vocabulary (id % vocab_size), ignored labels kept."""
    out = []
    for x, y in batches:
        y = torch.where(y == ignore_index, y, y % vocab_size)
        out.append((x % vocab_size, y))
    return out


def first_batches(original: Config, replica: Config, steps: int) -> list:
    """The first `steps` global batches of the run's own data (its corpus or SFT set, tokenized as the run
    tokenizes it: the same token cache), cut at the replica's seq_len and global batch, ids folded into the
    replica's vocabulary."""
    from meshlm.data import prepare_data
    from meshlm.model.pretrained import init_tokenizer

    data = prepare_data(original.data, original.model.build().vocab_size, init_tokenizer(original.model.init_from))
    sampler = data.sampler(replica.data.seq_len, replica.train.global_batch, replica.train.seed)
    batches = [sampler.next_batch(0, 1) for _ in range(steps)]
    return map_ids(batches, replica.model.build().vocab_size, replica.train.ignore_index)


def check_model(
    model: object,
    data: list,
    layout: str,
    *,
    plan: object = None,
    loss_fn: object = None,
    gather_logits: bool = False,
    steps: int = 5,
    micro_batch: int = 0,
    workdir: Path | None = None,
    say=lambda line: None,
    **parallel: object,
) -> CheckReport:
    """`meshlm.check`: the user's model factory, plan and loss (what `meshlm.fit` takes), on the first `steps`
    global batches of `data`, at `layout` (at most a few CPU ranks: give a small model) against one process.
    `parallel` are [parallel] fields (zero=, sequence_parallel=, schedule=, virtual_stages=, ...). The model
    factory and loss must be importable (module-level), as torchrun's ranks unpickle them."""
    import tempfile

    batches = [batch for batch, _ in zip(data, range(steps), strict=False)]
    if len(batches) < steps:
        raise CheckError(f"data: {len(batches)} batches, the check needs steps = {steps}")
    rows, seq_len = batches[0][0].shape
    cfg = Config.model_validate(
        {
            "data": {"seq_len": seq_len},
            "train": {"global_batch": rows, "micro_batch": micro_batch, "device": "cpu", "compile": False},
            "parallel": {"layout": layout, **parallel},
        }
    )
    parts = {"model": model, "plan": plan, "loss_fn": loss_fn, "gather_logits": gather_logits}
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="meshlm-check-"))
    return check(cfg, batches, Path(workdir), steps=steps, parts=parts, say=say)


def short(tolerance: str) -> str:
    """A tolerance without its parenthesised reasons (the table's column; the reasons are printed below it)."""
    while (shorter := re.sub(r" ?\([^()]*\)", "", tolerance)) != tolerance:
        tolerance = shorter
    return tolerance


def render(report: CheckReport, kept: tuple[str, ...] = (), shrunk: tuple[str, ...] = ()) -> None:
    """The verdict table, the replica's kept and shrunk lines and each phase's time, on stdout."""
    from rich.console import Console
    from rich.table import Table

    def num(x: float | None) -> str:
        return "" if x is None else f"{x:.1e}"

    console = Console()  # the terminal's width (COLUMNS): the table fits 80 columns, the whys below it
    for line in kept:
        console.print(f"kept: {line}", highlight=False)
    for line in shrunk:
        console.print(f"shrunk: {line}", highlight=False)
    table = Table(title=f"meshlm check: layout {report.layout} against one process (relative differences)")
    logits = any(r.d_logits is not None for r in report.rows)  # the export rows' column, with --export only
    columns = ("check", "Δ loss", "Δ grad norm", "Δ weights", *(("Δ logits",) * logits), "tolerance")
    for column in (*columns, "time", "verdict"):
        table.add_column(column)
    for r in report.rows:
        verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        numbers = [num(x) for x in (r.d_loss, r.d_grad_norm, r.d_weights, *((r.d_logits,) * logits))]
        table.add_row(r.check, *numbers, short(r.tolerance), f"{r.seconds:.0f} s", verdict)
    console.print(table)
    for why in dict.fromkeys(r.tolerance for r in report.rows if "(" in r.tolerance):
        console.print(f"tolerance: {why}", highlight=False)
    for r in report.rows:
        if r.note:
            console.print(f"{r.check}: {r.note}", highlight=False)
    if report.culprit:
        console.print(f"localised: {report.culprit}", highlight=False)
    console.print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.phases.items()), highlight=False)
    console.print("PASS: the layout reproduces one process" if report.passed else "FAIL", highlight=False)


def check_config(cfg: Config, *, steps: int, world: int | None, max_ranks: int, workdir: Path, export: bool = False,
                 say=lambda line: None) -> tuple[CheckReport, object]:  # fmt: skip
    """`meshlm check`: the run's replica (meshlm.check.shrink), its first batches, and `check`; with `export`
    the export round trip too (bad input for it refused first, on the run's model and on the replica's)."""
    from meshlm.check.export import check_export_input
    from meshlm.check.shrink import shrink

    if export:
        check_export_input(cfg)
    start = time.monotonic()
    replica = shrink(cfg, workdir, world=world, max_ranks=max_ranks)
    if export:
        check_export_input(replica.config)
    shrunk_s = time.monotonic() - start
    start = time.monotonic()
    batches = first_batches(cfg, replica.config, steps)
    data_s = time.monotonic() - start
    report = check(replica.config, batches, workdir, steps=steps, export=export, say=say)
    report.phases = {"shrink": round(shrunk_s, 2), "data": round(data_s, 2), **report.phases}
    return report, replica
