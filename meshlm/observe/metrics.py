"""Where training numbers go: a JSONL file (the source of truth), TensorBoard, and a rich progress bar.

`metrics.jsonl` survives crashes: a last line cut mid-write is ended on open (so the next record is not glued
onto it), a run that appends to an existing file first writes a `resume` record (the steps after it replace
those the earlier run logged past that step), and readers skip and count lines that do not parse.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

TAIL = 1 << 20  # bytes searched for the last line's start


def _storage_error(error: OSError, path: Path) -> Exception:
    """A full disk or a permission problem as one line naming the file (checkpoint imports torch: lazily)."""
    from meshlm.checkpoint.store import StorageError, storage_cause

    return StorageError(f"metrics cannot be written: {storage_cause(error, path)}")


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


class MetricsLogger:
    """Appends one JSON object per record to `run_dir/metrics.jsonl`; mirrors scalars to TensorBoard.

    `start_step`: where this run starts; when the file already has records, a `resume` record at that step
    marks the restart. A write that fails (disk full, permission) raises StorageError naming the file."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        start_step: int | None = None,
        say: Callable[[str], Any] = print,
    ) -> None:
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

            try:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except OSError as e:  # a full disk or a read-only run directory
                raise _storage_error(e, run_dir / "tensorboard") from None
        if resumed and start_step is not None:
            self.log(start_step, "resume", torn_line=int(bool(torn)))

    def log(self, step: int, kind: str, **values: Any) -> None:
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None:
                for name, value in values.items():
                    if isinstance(value, int | float):
                        self._tb.add_scalar(f"{kind}/{name}", value, step)
        except OSError as e:
            raise _storage_error(e, self.path) from None

    def close(self) -> None:
        try:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
        except OSError as e:
            raise _storage_error(e, self.path) from None


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


class TrainProgress:
    """A rich progress bar showing step, loss, tokens/s and ETA; a no-op when disabled (tests, non-zero ranks)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool) -> None:
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  {task.fields[extra]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, loss=0.0, tps=0.0, extra=""
            )

    def __enter__(self) -> TrainProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tokens_per_s, extra=extra)

    def print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
