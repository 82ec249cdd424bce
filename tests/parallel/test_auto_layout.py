"""Scaling with the pool: under `--parallel.layout auto` every (re)start picks the planner's layout for the
world it got, reshards the newest checkpoint into it and continues the same data order.

A run trained 4 → 2 → 4 ranks (a shrink and a regrow, each a restart) must give the loss curve of the
uninterrupted single-process run, step for step within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_distributed

from meshlm.config import load_config, parse_overrides
from meshlm.data import prepare_data
from meshlm.train.trainer import train

SEGMENT = 3  # steps per (re)start


def _overrides(small_run: list[str], run_dir: Path, steps: int) -> list[str]:
    # A constant learning rate: a segment's schedule must not depend on where the run stops.
    return [*small_run, "--log.run_dir", str(run_dir), "--parallel.layout", "auto", "--train.steps", str(steps),
            "--train.warmup_steps", "0", "--train.min_lr_ratio", "1.0", "--train.eval_every", "0",
            "--checkpoint.async_save", "false", "--fault.desync_every", "0"]  # fmt: skip


def _segment(overrides: list[str]) -> dict:
    result = train(load_config(None, parse_overrides(overrides)))
    return {"losses": result.losses, "start": result.start_step}


@pytest.mark.slow  # a reference run and three restarted segments on four ranks: ~11 s
def test_auto_layout_repicks_on_every_restart_and_continues_the_curve(small_run: list[str], tmp_path: Path) -> None:
    cfg = load_config(None, parse_overrides(small_run))
    prepare_data(cfg.data, cfg.model.build().vocab_size)  # tokenize once, before the ranks start
    reference = _segment(_overrides(small_run, tmp_path / "reference", 3 * SEGMENT))["losses"]

    run = tmp_path / "elastic"
    curve, starts = [], []
    for world, steps in ((4, SEGMENT), (2, 2 * SEGMENT), (4, 3 * SEGMENT)):
        first = run_distributed(_segment, world, _overrides(small_run, run, steps), timeout=300)[0]
        curve += first["losses"]
        starts.append(first["start"])
    assert starts == [0, SEGMENT, 2 * SEGMENT]
    assert curve == pytest.approx(reference, rel=1e-5)
    layouts = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "env"' in line]
    assert len(layouts) == 3  # one environment record per start, each naming the layout it picked
