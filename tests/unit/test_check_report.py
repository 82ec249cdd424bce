"""The check's report and input, without torchrun (issues 47 and 49): `CheckReport.to_json()` is JSON text; the
table fits 80 columns; the replica lists a layout it keeps as kept, not shrunk; a plan built inside a
function is refused in one line naming it, before any run.

Mutations: `to_json` returning the dict (json.loads raises TypeError); the table at a fixed 120 columns (its
lines are 120 wide); the layout always under shrunk (issue 49's "layout tp=2 -> tp=2"); run_job pickling the
job without its check (the bare "Can't pickle local object" AttributeError).
"""

from __future__ import annotations

import json

import pytest
from check_models import KBIAS_PLAN, batches

import meshlm
from meshlm.check.run import CheckError, CheckReport, Row, print_verdict
from meshlm.check.shrink import shrink
from meshlm.config import load_config
from meshlm.parallel.parallel_plan import ParallelPlan

WHY = "loss, norm <= 1e-05 (fp32: reduction order moves a mean by ~1e-7 rel; a bug by O(1e-2)); weights <= 1e-05"


def report() -> CheckReport:
    rows = [
        Row("5 steps at pp=2,dp=2,tp=2 vs world 1", 1e-7, 2e-7, 3e-4, WHY, 80.5, False, "first tensor: x (3e-4)"),
        Row("step-1 gradients per tensor", None, 7.1e-7, 7.4e-1, "<= 1e-05 per tensor", 6.3, False),
    ]
    phases = {"layout pp=2,dp=2,tp=2 (8 ranks)": 80.5, "reference (world 1)": 38.1}
    return CheckReport("pp=2,dp=2,tp=2", rows, phases, "model.layers.0.mlp.up: its output agrees gathered")


def test_to_json_is_json_text() -> None:
    text = report().to_json()
    assert isinstance(text, str) and json.loads(text) == report().as_dict()
    assert json.loads(text)["checks"][0]["d_weights"] == 3e-4


def test_the_table_fits_80_columns(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    print_verdict(report(), ("family llama",), ("hidden 8192 -> 64",))
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert len(lines) <= 30, "\n".join(lines)  # was 70 at 80 columns (issue 49): the reasons wrapped in a column
    assert any(line.startswith("tolerance: loss, norm <= 1e-05 (fp32:") for line in lines), lines


def test_a_kept_layout_is_not_listed_as_shrunk(tmp_path) -> None:
    cfg = load_config(None, [("model.preset", "test"), ("parallel.layout", "tp=2"), ("data.seq_len", 32)])
    replica = shrink(cfg, tmp_path)
    assert not any(line.startswith("layout") for line in replica.shrunk), replica.shrunk
    assert "layout pp=1,dp=1,tp=2" in replica.kept, replica.kept
    wide = shrink(load_config(None, [("model.preset", "test"), ("parallel.layout", "dp=16"), ("data.seq_len", 32)]),
                  tmp_path)  # fmt: skip
    assert any(line.startswith("layout ") and "dp=16" in line and "-> " in line for line in wide.shrunk), wide.shrunk


def test_a_plan_built_inside_a_function_is_one_line(tmp_path) -> None:
    def local_plan() -> ParallelPlan:
        return ParallelPlan("local", KBIAS_PLAN.tensor_parallel, head_dim=lambda model: 8)

    from check_models import kbias

    with pytest.raises(CheckError) as e:
        meshlm.check(kbias, batches(), "tp=2", plan=local_plan(), workdir=tmp_path)
    line = str(e.value)
    assert "\n" not in line and line.startswith("plan 'local' cannot reach the check's ranks"), line
    assert "define them at module level" in line and "docs/check.md" in line, line
    assert not (tmp_path / "layout.log").exists()  # refused before any run
