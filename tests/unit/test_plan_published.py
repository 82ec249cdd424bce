"""The planner against published large-scale runs, as docs/planner.md records them ("Published runs").

Every row of the throughput and memory tables there has a `meshlm plan` command in the page's command block.
Each is run with `--json --top 1`; the planner's figure must be the page's "predicted" column (3 significant
digits) and its ratio to the published figure the "ratio" column, and a row marked "yes" must hold (throughput
within 15 %, memory within 10 %) while one marked "no" must stay outside, so the page cannot go stale. The "fit"
column says whether a constant of the planner was chosen against the row ("fitted") or not ("held out").
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlm.plan.cli import add_plan_parser, run_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "planner.md"
TOLERANCE = {"Throughput per GPU": 0.15, "Memory per GPU": 0.10}


@dataclass(frozen=True)
class Row:
    id: str
    table: str
    published: float
    predicted: str
    ratio: str
    holds: bool
    fit: str  # "fitted": a constant of the planner was chosen against it; "held out": it was not
    field: str
    args: tuple[str, ...]


def rows() -> list[Row]:
    """The validation rows: the tables' columns joined with the command block by id."""
    text = DOC.read_text()
    section = text[text.index("## Published runs") :]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    commands = {}
    for line in block[1].splitlines():
        rid, field, args = line.split(" ", 2)
        commands[rid] = (field, tuple(shlex.split(args)))
    found, table = [], None
    for line in section.splitlines():
        if line.startswith("### "):
            table = line[4:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if table in TOLERANCE and re.fullmatch(r"[A-Z]\d+", cells[0]):
            fit, published, predicted, ratio, holds = cells[-5:]
            field, args = commands[cells[0]]
            found.append(Row(cells[0], table, float(published), predicted, ratio, holds == "yes", fit, field, args))
    assert len(found) == len(commands), "every table row needs a command and every command a row"
    return found


ROWS = rows()


def planner_figure(row: Row, capsys: pytest.CaptureFixture) -> float:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    assert run_plan(parser.parse_args(["plan", *row.args, "--json", "--top", "1"])) == 0, capsys.readouterr().err
    value = json.loads(capsys.readouterr().out)["plans"][0]
    for key in row.field.split("."):
        value = value[key]
    return value


def test_the_page_has_every_kind_of_row() -> None:
    assert {r.table for r in ROWS} == set(TOLERANCE)
    assert {r.field for r in ROWS} >= {"hardware_tflops_per_gpu", "tflops_per_gpu", "memory_gb_per_gpu"}
    assert sum(r.holds for r in ROWS) >= 18
    assert {r.fit for r in ROWS} == {"fitted", "held out"}
    assert sum(r.fit == "held out" for r in ROWS) >= 6


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_published_row(row: Row, capsys: pytest.CaptureFixture) -> None:
    figure = planner_figure(row, capsys)
    ratio = figure / row.published
    assert f"{figure:.3g}" == row.predicted, f"{row.id}: planner says {figure:.4g}, docs/planner.md {row.predicted}"
    assert f"{ratio:.2f}" == row.ratio, f"{row.id}: ratio {ratio:.3f}, docs/planner.md {row.ratio}"
    within = abs(ratio - 1) <= TOLERANCE[row.table]
    assert within == row.holds, f"{row.id}: ratio {ratio:.3f}; docs/planner.md says holds={row.holds}"


# What a published layout chose and its question leaves to the search; the rest (the stack's recompute, ZeRO,
# sequence parallelism, kernels, runtime, memory) stays as the row's command gives it.
TUNED = {"--layout", "--micro-batch", "--schedule", "--virtual-stages"}
PICK_TOLERANCE = 1.15  # the search's own pick: at most this far above the published figure, unless explained


def own_question(args: tuple[str, ...]) -> list[str]:
    """The row's command without the published layout's tuned choices (each flag and its value)."""
    kept, skip = [], False
    for arg in args:
        if not skip and arg not in TUNED:
            kept.append(arg)
        skip = not skip and arg in TUNED
    return kept


def documented_picks() -> dict[str, tuple[str, str, str]]:
    """id -> (pick, ratio, why) from the page's table of the search's own picks."""
    text = DOC.read_text()
    section = text[text.index("### The search's own pick") :]
    section = section[: section.index("\n#", 1)]
    picks = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if re.fullmatch(r"[A-Z]\d+", cells[0]):
            picks[cells[0]] = (cells[1], cells[2], cells[3])
    return picks


def describe(plan: dict) -> str:
    schedule = plan["schedule"] + (f"×{plan['virtual_stages']}" if plan["schedule"] == "interleaved" else "")
    return f"{plan['layout']} zero={plan['zero']} mb={plan['micro_batch']} {schedule}"


THROUGHPUT = [r for r in ROWS if r.table == "Throughput per GPU"]


def test_every_throughput_row_has_its_pick() -> None:
    assert set(documented_picks()) == {r.id for r in THROUGHPUT}


@pytest.mark.slow  # one search per published question, ~1-10 s each: ~1 min quiet
@pytest.mark.parametrize("row", THROUGHPUT, ids=lambda r: r.id)
def test_search_pick_on_the_published_question(row: Row, capsys: pytest.CaptureFixture) -> None:
    """The search's own pick for the row's question (its layout, micro-batch and schedule free) is what the
    page shows, and is predicted at most PICK_TOLERANCE above the published figure unless the page says why."""
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *own_question(row.args), "--json", "--top", "1"])
    assert run_plan(args) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    ratio = plan[row.field] / row.published
    pick, shown_ratio, why = documented_picks()[row.id]
    assert (describe(plan), f"{ratio:.2f}") == (pick, shown_ratio), (
        f"{row.id}: docs/planner.md shows {pick} {shown_ratio}"
    )
    assert ratio <= PICK_TOLERANCE or why not in ("", "—"), f"{row.id}: pick {ratio:.2f}× published, unexplained"
