"""The `meshlm plan` table at a narrow terminal and the lines under it (meshlm.plan.table): no two rows read
the same at 80 columns, #1's lead over #2 is named by the step-time part that separates them, and a mixture of
experts picked without expert parallelism says so. Mutations that fail: dropping columns by DROP_ORDER alone
(the 80-column test: rows 1-3 of llama3-1b on 8 GPUs read 'pp=1,dp=8,tp=1 1f1b' each), taking #2's parts only
from #1's keys (the ep_comm test: an all-to-all #1 does not have goes unnamed)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from rich.console import Console

from meshlm.model.config import preset
from meshlm.plan import Workload, hardware
from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.search import Constraints, search
from meshlm.plan.step_time import StepTime
from meshlm.plan.table import STRATEGY, distinct, expert_parallel_note, fitted_table, why_first


def _plan(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    assert run_plan(parser.parse_args(["plan", *argv])) == 0
    return capsys.readouterr().out


def test_no_two_rows_read_the_same_at_80_columns(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """llama3-1b on 8 H100s: the top rows are one mesh at micro-batches 1, 2 and 4 (a tie on time, ranked by
    memory); at 80 columns the table keeps a column that tells them apart and still fits."""
    monkeypatch.setenv("COLUMNS", "80")
    out = _plan(["--model", "llama3-1b", "--gpus", "8", "--top", "10"], capsys)
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 10
    assert max(len(line) for line in out.splitlines() if line[:1] in "┏┃┡│└") <= 80
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    names = [c.strip() for c in header.strip("┃").split("┃")]
    kept = [i for i, name in enumerate(names) if name in STRATEGY]  # what a row is, not what it gives
    cells = [tuple(c.strip() for c in line.strip("│").split("│")) for line in rows]
    assert len({tuple(row[i] for i in kept) for row in cells}) == len(cells), "\n".join(rows)
    assert "GiB/GPU" in out or "GiB/GPU" in out.split("not shown at 80 columns:")[1]
    assert "#2: " in out


def test_fitted_table_keeps_the_columns_rows_differ_by() -> None:
    rows = [
        {name: "x" for name in ("#", "layout", "zero", "schedule", "recompute", "sp", "GiB/GPU", "step s", "tok/s",
                                "TFLOP/s", "MFU", "on demand", "spot", "mixed", "restarts", "ckpt every")} | {"mb": mb}
        for mb in ("1", "2")
    ]  # fmt: skip
    table, dropped = fitted_table("t", rows, Console(width=40))
    assert "mb" not in dropped and "mb" in {str(c.header) for c in table.columns}
    assert distinct(rows, ["mb"]) and not distinct(rows, [n for n in STRATEGY if n != "mb"])


def test_why_first_names_the_part_that_separates_the_first_two() -> None:
    """Mixtral on 16 H100s: a layout with ep pays an all-to-all the one without does not have; that part
    (absent from #1's parts) is what the line names, with #2's saving elsewhere."""
    w = Workload(preset("mixtral-8x7b"), 4096, 64, 1e12, name="mixtral")
    hw = hardware("H100-SXM")
    fixed = Constraints(pp=2, tp=2, zero=3, micro_batch=1, schedule="1f1b", recompute="none")  # keeps it cheap
    plans = search(w, 16, hw, constraints=fixed).plans
    no_ep = next(p for p in plans if p.strategy.ep == 1)
    with_ep = next(p for p in plans if p.strategy.ep > 1)
    line = why_first([no_ep, with_ep], hw)
    delta = with_ep.step.total - no_ep.step.total
    assert line.startswith(f"#2: {delta:+.3g} s/step")
    assert "expert all-to-all in a node" in line or with_ep.step.ep_comm < max(
        getattr(with_ep.step, k) - getattr(no_ep.step, k) for k in ("compute", "dp_comm", "bubble", "pp_comm")
    )
    note = expert_parallel_note([no_ep, with_ep], w.model)
    assert note.startswith("#1 drops expert parallelism (ep=1): every rank holds all 8 experts")
    assert with_ep.strategy.layout in note
    assert expert_parallel_note([with_ep, no_ep], w.model) is None


def test_why_first_on_a_tie_names_the_memory() -> None:
    w = Workload(preset("llama3-1b"), 8192, 8, 1e12, name="llama3-1b")
    hw = hardware("H100-SXM")
    plans = search(w, 1, hw).plans
    one, two = plans[0], dataclasses.replace(plans[0], step=dataclasses.replace(plans[0].step))
    assert why_first([one, two], hw) == "#2: the same step time and memory"
    later = dataclasses.replace(two, step=StepTime(**{**dataclasses.asdict(two.step), "bubble": 0.5}))
    line = why_first([one, later], hw)
    assert line.startswith("#2: +0.5 s/step") and line.endswith("+0.5 s pipeline bubble")  # no link: no place
