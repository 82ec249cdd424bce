"""Fault D of issue #14: metrics.jsonl after crashes. A last line cut mid-write is ended on open (the resumed
run's records are not glued onto it), a resume is marked, and `meshlm report` skips and counts bad lines and
shows each resume instead of crashing."""

from __future__ import annotations

import argparse
import errno
import json
from pathlib import Path

import pytest

from meshlm.checkpoint import StorageError
from meshlm.config import load_config, parse_overrides
from meshlm.observe.metrics import MetricsLogger, latest_timeline, load_metrics, read_metrics
from meshlm.observe.report import add_report_parser, build_report, loss_plot, mark_resumes, run_report
from meshlm.train.trainer import train


def test_torn_last_line_is_ended_and_the_restart_is_marked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 3, "kind": "train", "loss": 2.0})
    path.write_text(whole + "\n" + whole[:17])  # the crash cut the second record
    logger = MetricsLogger(tmp_path, tensorboard=False, start_step=2)
    logger.log(3, "train", loss=1.5)
    logger.close()
    (said,) = capsys.readouterr().out.splitlines()
    assert f"{path}: its last line (17 bytes) was cut mid-write" in said
    records, bad = load_metrics(tmp_path)
    assert bad == [2]  # the torn fragment alone; nothing glued onto it
    assert [(r["step"], r["kind"]) for r in records] == [(3, "train"), (2, "resume"), (3, "train")]
    assert records[1]["torn_line"] == 1


def test_a_whole_record_missing_only_its_newline_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}))
    MetricsLogger(tmp_path, tensorboard=False, start_step=1).close()
    assert capsys.readouterr().out == ""
    assert load_metrics(tmp_path) == (read_metrics(tmp_path), [])
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["train", "resume"]


def test_a_new_run_writes_no_resume_record(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False, start_step=0)
    logger.log(1, "train", loss=1.0)
    logger.close()
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["train"]


def test_latest_timeline_replaces_the_steps_a_resume_redid() -> None:
    first = [{"step": s, "kind": "train", "loss": 1.0} for s in (1, 2, 3, 4)]
    again = [{"step": 2, "kind": "resume"}, *({"step": s, "kind": "train", "loss": 0.5} for s in (3, 4, 5))]
    timeline = latest_timeline(first + again)
    assert [(r["step"], r["kind"], r.get("loss")) for r in timeline] == [
        (1, "train", 1.0), (2, "train", 1.0), (2, "resume", None),
        (3, "train", 0.5), (4, "train", 0.5), (5, "train", 0.5),
    ]  # fmt: skip


def test_report_skips_and_counts_bad_lines_and_marks_resumes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = [json.dumps({"step": s, "kind": "train", "loss": 3.0 - 0.1 * s}).encode() for s in range(1, 6)]
    lines[1] = b"\xff\xfe binary garbage"  # UnicodeDecodeError before
    lines[3] = lines[3][:9]  # JSONDecodeError before
    lines.append(b'["a list, not a record"]')
    lines.append(json.dumps({"step": 2, "kind": "checkpoint", "status": "failed", "error": "disk full"}).encode())
    lines.append(json.dumps({"step": 3, "kind": "resume"}).encode())
    lines += [json.dumps({"step": s, "kind": "train", "loss": 2.0}).encode() for s in (4, 5, 6)]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers())
    assert run_report(parser.parse_args(["report", str(tmp_path)])) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"meshlm report: {tmp_path}/metrics.jsonl: 3 unreadable lines skipped (lines 2, 4, 6)"
    page = (tmp_path / "report.html").read_text()
    assert "3 unreadable lines skipped (lines 2, 4, 6)" in page
    assert "<td>resumed at</td><td>step 3</td>" in page and "dotted lines: resumes" in page
    assert "<td>failed checkpoint saves</td><td>step 2: disk full</td>" in page
    assert "steps logged</td><td>1 … 6 (5 records)" in page  # 1, 3 from the first attempt, then 4, 5, 6

    run = {"train": latest_timeline(read_metrics(tmp_path, "train")), "eval": []}
    fig = loss_plot(run)
    mark_resumes(fig, [3])
    assert [line.get_xdata()[0] for line in fig.axes[0].lines if line.get_linestyle() == ":"] == [3]


def test_resumed_run_marks_its_resume_and_reports(
    small_run: list[str], capsys: pytest.CaptureFixture
) -> None:  # fmt: skip
    args = [*small_run, "--train.eval_every", "0", "--log.peak_flops", "1e12", "--log.every", "1",
            "--checkpoint.every", "2"]  # fmt: skip
    run_dir = train(load_config(None, parse_overrides([*args, "--train.steps", "3"]))).run_dir
    with (run_dir / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 4, "kind": "tra')  # killed mid-write
    capsys.readouterr()
    train(load_config(None, parse_overrides([*args, "--train.steps", "4"])))
    assert "was cut mid-write" in capsys.readouterr().out
    records, bad = load_metrics(run_dir)
    assert len(bad) == 1
    resume = [r for r in records if r["kind"] == "resume"]
    assert [r["step"] for r in resume] == [3]  # from the checkpoint of step 3
    assert [r["step"] for r in latest_timeline(records) if r["kind"] == "train"] == [1, 2, 3, 4]
    page = build_report(run_dir).read_text()
    assert "<td>resumed at</td><td>step 3</td>" in page


class _FullFile:
    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, _text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", self.name)


def test_a_metrics_write_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger._file = _FullFile(str(logger.path))
    with pytest.raises(StorageError) as failed:
        logger.log(1, "train", loss=1.0)
    assert str(failed.value) == f"metrics cannot be written: {logger.path}: no space left on device"


def test_tensorboard_on_a_full_disk_is_one_line_naming_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard writes from a thread of its own: the disk filling up under it ends in meshlm's one line
    naming the tensorboard folder, with no thread traceback printed before it."""
    errors: list[str] = []
    monkeypatch.setattr("threading.excepthook", lambda args: errors.append(repr(args.exc_value)))
    logger = MetricsLogger(tmp_path, tensorboard=True)

    def full(_data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async_writer = logger._tb.file_writer.event_writer._async_writer
    monkeypatch.setattr(async_writer._writer._writer, "write", full)
    logger.log(1, "train", loss=2.0)
    async_writer._worker.join(timeout=60)  # the writer thread met the full disk and stopped
    with pytest.raises(StorageError, match=f"{tmp_path / 'tensorboard'}.*no space left on device"):
        logger.log(2, "train", loss=1.9)
    assert errors == [] and capsys.readouterr().err == ""
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # metrics.jsonl, the source of truth, has both
