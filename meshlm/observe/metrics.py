"""Where training numbers go: a JSONL file (the source of truth), TensorBoard, optionally Weights & Biases and
MLflow (`log.wandb_project`, `log.mlflow_experiment`; extras `meshlm[wandb]`, `meshlm[mlflow]`), and the
console: a rich progress bar on a terminal, plain lines (`step 10/400 loss ... ETA ...`) in a batch job.

`metrics.jsonl` survives crashes: a last line cut mid-write is ended on open (so the next record is not glued
onto it), a run that appends to an existing file first writes a `resume` record (the steps after it replace
those the earlier run logged past that step), and readers skip and count lines that do not parse. TensorBoard
and the trackers cannot replace a step, so after a resume they get only steps past the last one logged before.

Each tracker run has an id of its own, made once per run directory and kept in it (`tracker_run.json`): a
resume continues the same W&B / MLflow run, and two people's `runs/tiny` are two runs, not one.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from meshlm.errors import InputError
from meshlm.files import atomic_write

TAIL = 1 << 20  # bytes searched for the last line's start


def _storage_error(error: OSError, path: Path) -> Exception:
    """A full disk or a permission problem as one line naming the file (checkpoint imports torch: lazily)."""
    from meshlm.checkpoint.store import StorageError, storage_cause

    return StorageError(f"metrics cannot be written: {storage_cause(error, path)}")


def _quiet_writer_thread(previous: Callable[[threading.ExceptHookArgs], Any]) -> Callable[..., Any]:
    """A `threading.excepthook` that says nothing for a storage error in TensorBoard's writer thread: that
    thread keeps the error and the next `add_scalar` raises it here, where it becomes one line; its own
    traceback, printed first, would bury that line. Every other thread's error goes to `previous`."""

    def hook(args: threading.ExceptHookArgs) -> Any:
        if not (type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError)):
            return previous(args)
        return None

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    return hook


def end_torn_line(path: Path) -> int:
    """If `path` does not end with a newline (a crash cut its last write), end it; return the length of that
    unterminated last line if it is not a whole JSON record (0 when nothing was torn)."""
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    with path.open("rb+") as f:
        f.seek(-min(TAIL, path.stat().st_size), os.SEEK_END)
        tail = f.read()
        if tail.endswith(b"\n"):
            return 0
        last = tail[tail.rfind(b"\n") + 1 :]
        f.write(b"\n")
    try:
        json.loads(last)
        return 0
    except ValueError:
        return len(last)


class TrackerError(InputError):
    """An experiment tracker that cannot start (package missing), in one line naming the field."""


def _module(name: str, field: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise TrackerError(f"{field} needs the {name} package: pip install 'meshlm[{name}]' (or leave {field} "
                           "empty)") from None  # fmt: skip


TRACKER_RUN = "tracker_run.json"


def tracker_ids(run_dir: Path) -> dict[str, str]:
    """The tracker run ids this run directory recorded (empty before its first start with a tracker)."""
    path = run_dir / TRACKER_RUN
    try:
        ids = json.loads(path.read_bytes()) if path.is_file() else {}
    except (OSError, ValueError):
        raise TrackerError(f"{path}: unreadable tracker run ids; delete it to start new tracker runs") from None
    return ids if isinstance(ids, dict) else {}


def record_tracker_id(run_dir: Path, tracker: str, run_id: str) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / TRACKER_RUN, json.dumps({**tracker_ids(run_dir), tracker: run_id}) + "\n")
    except OSError as e:
        raise _storage_error(e, run_dir / TRACKER_RUN) from None


def _start_failed(field: str, what: str, error: Exception) -> TrackerError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return TrackerError(f"{field}: {what} could not start a run ({reason}); fix that or leave {field} empty")


class WandbSink:
    """Scalars to a Weights & Biases run (`log.wandb_project`) named after the run directory, under an id unique
    to it (recorded in tracker_run.json, so a resume continues the same W&B run)."""

    def __init__(self, project: str, run_dir: Path, config: dict | None = None) -> None:
        wandb = _module("wandb", "log.wandb_project")
        run_id = tracker_ids(run_dir).get("wandb") or f"{run_dir.name}-{uuid.uuid4().hex[:8]}"
        try:
            self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow",
                                  dir=str(run_dir), config=config or {})  # fmt: skip
        except Exception as e:  # wandb raises its own errors (login, network, a bad project name)
            raise _start_failed("log.wandb_project", "W&B", e) from None
        record_tracker_id(run_dir, "wandb", run_id)

    def log(self, step: int, kind: str, values: dict[str, float]) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """Scalars to an MLflow run in experiment `log.mlflow_experiment` (tracking URI from MLFLOW_TRACKING_URI);
    the run's id is recorded in tracker_run.json, so a resume continues it."""

    def __init__(self, experiment: str, run_dir: Path, config: dict | None = None) -> None:
        self.mlflow = _module("mlflow", "log.mlflow_experiment")
        previous = tracker_ids(run_dir).get("mlflow")
        try:
            self.mlflow.set_experiment(experiment)
            run = self.mlflow.start_run(run_id=previous) if previous else self.mlflow.start_run(run_name=run_dir.name)
            if config and not previous:
                self.mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
        except Exception as e:  # mlflow raises its own errors (a refused store, a server down)
            raise _start_failed("log.mlflow_experiment", "MLflow", e) from None
        record_tracker_id(run_dir, "mlflow", run.info.run_id)

    def log(self, step: int, kind: str, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{kind}.{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def trackers(run_dir: Path, wandb_project: str = "", mlflow_experiment: str = "", config: dict | None = None) -> list:
    """The experiment trackers asked for (none by default)."""
    sinks: list = []
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_dir, config))
    if mlflow_experiment:
        sinks.append(MlflowSink(mlflow_experiment, run_dir, config))
    return sinks


class MetricsLogger:
    """Appends one JSON object per record to `run_dir/metrics.jsonl`; mirrors scalars to TensorBoard and to
    the experiment trackers in `sinks` (`trackers`).

    `start_step`: where this run starts; when the file already has records, a `resume` record at that step
    marks the restart. A write that fails (disk full, permission) raises StorageError naming the file."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        start_step: int | None = None,
        say: Callable[[str], Any] = print,
        sinks: list | None = None,
    ) -> None:
        self._sinks = list(sinks or [])
        self.path = run_dir / "metrics.jsonl"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = end_torn_line(self.path)
            resumed = self.path.is_file() and self.path.stat().st_size > 0
            self._file = self.path.open("a")
        except OSError as e:
            raise _storage_error(e, self.path) from None
        if torn:
            say(f"{self.path}: its last line ({torn} bytes) was cut mid-write; ended it, it will be skipped")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if not getattr(threading.excepthook, "quiets_tensorboard", False):
                threading.excepthook = _quiet_writer_thread(threading.excepthook)
            self._tb_dir = run_dir / "tensorboard"
            try:
                self._tb = SummaryWriter(log_dir=str(self._tb_dir))
            except OSError as e:  # a full disk or a read-only run directory
                raise _storage_error(e, self._tb_dir) from None
        # TensorBoard and the trackers already hold the steps logged before a resume: only later ones go there
        self._mirrored_up_to = max((r["step"] for r in load_metrics(run_dir)[0]), default=-1) if resumed else -1
        if resumed and start_step is not None:
            self.log(start_step, "resume", torn_line=int(bool(torn)))

    def log(self, step: int, kind: str, **values: Any) -> None:
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            raise _storage_error(e, self.path) from None
        if step <= self._mirrored_up_to:
            return
        scalars = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            try:
                for name, value in scalars.items():
                    self._tb.add_scalar(f"{kind}/{name}", value, step)
            except OSError as e:  # what TensorBoard's writer thread met (a full disk), raised on this call
                raise _storage_error(e, self._tb_dir) from None
        for sink in self._sinks:
            sink.log(step, kind, scalars)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        try:
            self._file.close()
        except OSError as e:
            raise _storage_error(e, self.path) from None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:
                raise _storage_error(e, self._tb_dir) from None


def load_metrics(run_dir: Path) -> tuple[list[dict], list[int]]:
    """The records of `run_dir/metrics.jsonl` in file order, and the numbers of the lines skipped because
    they do not parse (torn by a crash, damaged bytes) or are not records (no integer step and kind)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return [], []
    records, bad = [], []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
            bad.append(number)
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or not isinstance(record.get("kind"), str):
            bad.append(number)
            continue
        records.append(record)
    return records, bad


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """Records of `run_dir/metrics.jsonl`, optionally only those of one kind ('train', 'eval', ...);
    unreadable lines are skipped (`load_metrics` counts them)."""
    return [r for r in load_metrics(run_dir)[0] if kind is None or r["kind"] == kind]


def latest_timeline(records: list[dict]) -> list[dict]:
    """The records as the run's final history: at each `resume` record (step s), what the earlier attempt
    logged after step s is dropped, since the resumed run did those steps again."""
    out: list[dict] = []
    for record in records:
        if record["kind"] == "resume":
            out = [r for r in out if r["step"] <= record["step"] or r["kind"] == "resume"]
        out.append(record)
    return out


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class TrainProgress:
    """Training progress on rank 0 (`rank0`): with `enabled` (log.progress), a rich bar on a terminal, or a
    plain line every `every` steps when stdout is not one (a batch job's log: step, loss, tokens/s, MFU,
    elapsed, ETA); `print` lines (faults, evaluations, stragglers) always, bar or not."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, rank0: bool | None = None,
                 every: int = 10, stream: Any = None) -> None:  # fmt: skip
        self._progress = None
        self.rank0 = enabled if rank0 is None else rank0
        self.stream = stream
        out = stream or sys.stdout
        self.plain = enabled and self.rank0 and not (hasattr(out, "isatty") and out.isatty())
        self.total, self.start_step, self.every = total_steps, start_step, max(1, every)
        self._t0 = time.monotonic()
        if enabled and self.rank0 and not self.plain:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),  # empty until step 1's numbers: no `loss 0.0000 0 tok/s`
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")

    def __enter__(self) -> TrainProgress:
        self._t0 = time.monotonic()
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if self._progress is not None:
            stats = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  {extra}"
            self._progress.update(self._task, completed=step, stats=stats)
        elif self.plain and (step % self.every == 0 or step == self.total or step == self.start_step + 1):
            elapsed = time.monotonic() - self._t0
            done = step - self.start_step
            eta = elapsed / done * (self.total - step) if done > 0 else 0.0
            self._say(f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s {extra} "
                      f"elapsed {_clock(elapsed)} ETA {_clock(eta)}".replace("  ", " "))  # fmt: skip

    def print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message)
        elif self.rank0:
            self._say(message)

    def _say(self, line: str) -> None:
        print(line, file=self.stream or sys.stdout, flush=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
