"""Where training numbers go: a JSONL file (the source of truth), TensorBoard, and a rich progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import TracebackType

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLogger:
    """Appends one JSON object per record to `run_dir/metrics.jsonl`; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, kind: str, **values: float) -> None:
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """Records of `run_dir/metrics.jsonl`, optionally only those of one kind ('train', 'eval', ...)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if kind is None or r["kind"] == kind]


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
