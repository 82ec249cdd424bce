"""Run a replica at world 1 and at its layout, each by the real trainer on gloo (the layout under torchrun), and
compare.

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
    """`meshlm.fit(cfg)` on `world` gloo ranks (under torchrun above world 1); rank 0's result
    (meshlm.check.worker). `start` (run directory, step): the run resumes that run's checkpoint of that step (0:
    none, a fresh start)."""
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
    # world 1 needs no agent: the worker alone, on its own one-rank group (meshlm.parallel.distributed), runs what
    # torchrun would start, and the agent's start (it imports torch too) was a third of such a run's CPU time
    agent = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    cmd = [sys.executable, *agent, "-m", "meshlm.check.worker", str(job)]
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
        reason = failure_reason(log.read_text(), done.returncode) if done.returncode else "exited 0 without its result"
        raise CheckError(f"check run {name} ({cfg.parallel.layout or 'world 1'}) failed: {reason} (log {log})")
    return pickle.loads(out.read_bytes())


def failure_reason(log: str, returncode: int = 1) -> str:
    """Why a check job failed, from its log: the last Python exception line a rank printed; else, for a rank
    killed by a signal (a C++ abort, a segfault), torchrun's root cause ("rank 0 died of SIGABRT"; at world 1,
    with no agent, the process's own `returncode`, -SIGNAL) with the last fatal line before it ("terminate
    called ...", "Fatal Python error: ..."; each rank's Python stacks follow it in the log: meshlm.check.worker
    enables faulthandler)."""
    lines = log.splitlines()
    errors = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]
    if errors:
        return errors[-1]
    cause = "\n".join(lines[next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), len(lines)) :])
    rank = re.search(r"rank\s*: (\d+)", cause)
    signal = re.search(r"Signal \d+ \((SIG\w+)\)", cause)
    if rank and signal:
        who, how = rank[1], signal[1]
    elif returncode < 0:
        who, how = "0", _signal_name(-returncode)
    else:
        return "no output"
    fatal = [line.strip() for line in lines if line.startswith(("terminate called", "Fatal Python error"))]
    return f"rank {who} died of {how}" + (f" ({fatal[0]})" if fatal else "")


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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


def check_replica(cfg: Config, batches: list, workdir: Path, *, steps: int = 5, parts: dict | None = None,
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
        report.rows.append(Row(f"{steps} steps at {layout} vs world 1", None, None, None, "runs", 0.0, False, str(e)))
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
        from meshlm.check.localise import localise

        localise(cfg, batches, workdir, report, parts, timed, differs[0] if differs else 1)
    return report


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
    return check_replica(cfg, batches, Path(workdir), steps=steps, parts=parts, say=say)


def short(tolerance: str) -> str:
    """A tolerance without its parenthesised reasons (the table's column; the reasons are printed below it)."""
    while (shorter := re.sub(r" ?\([^()]*\)", "", tolerance)) != tolerance:
        tolerance = shorter
    return tolerance


def print_verdict(report: CheckReport, kept: tuple[str, ...] = (), shrunk: tuple[str, ...] = ()) -> None:
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


def check_run(cfg: Config, *, steps: int, world: int | None, max_ranks: int, workdir: Path, export: bool = False,
                 say=lambda line: None) -> tuple[CheckReport, object]:  # fmt: skip
    """`meshlm check`: the run's replica (meshlm.check.shrink), its first batches, and `check_replica`; with `export`
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
    report = check_replica(replica.config, batches, workdir, steps=steps, export=export, say=say)
    report.phases = {"shrink": round(shrunk_s, 2), "data": round(data_s, 2), **report.phases}
    return report, replica
