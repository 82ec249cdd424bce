"""A PyTorch profiler trace of a chosen range of steps (`log.profile_steps = "5:7"`): one Chrome trace per
rank, to open in chrome://tracing or https://ui.perfetto.dev. Steps are numbered as logged (the first is 1)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from meshlm.config import parse_steps


class StepProfiler:
    """Starts torch.profiler before step FIRST and writes `out_dir/trace_rank{R}_steps{FIRST}-{LAST}.json`
    after step LAST. Does nothing when the range is empty or the run resumes past it."""

    def __init__(self, steps: str, out_dir: Path, rank: int, device: torch.device) -> None:
        self.window = parse_steps(steps)
        self.out_dir, self.rank = Path(out_dir), rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profiler: profile | None = None

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self._profiler = profile(activities=self.activities)
            self._profiler.__enter__()

    def after_step(self, step: int) -> Path | None:
        """The trace's path when this step closed the window, else None."""
        if self._profiler is None or step != self.window[1]:
            return None
        self._profiler.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_rank{self.rank}_steps{self.window[0]}-{self.window[1]}.json"
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        return path
