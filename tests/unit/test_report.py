"""`meshlm report`: a self-contained HTML page with embedded plots, for full and for older, sparser runs."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from meshlm.config import load_config, parse_overrides
from meshlm.observe.report import add_report_parser, build_report, run_report
from meshlm.train.trainer import train

ALL_PLOTS = ("Loss", "Throughput", "MFU", "Time breakdown", "Memory", "Ranks")


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


def _write_run(run_dir: Path, records: list[dict], config: str = '[train]\ndevice = "cpu"\n') -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.toml").write_text(config)
    return run_dir


def _synthetic_records(steps: int = 20) -> list[dict]:
    records = [{"step": 0, "kind": "env", "torch": "9.9.9-test", "device": "cpu", "world_size": 4, "layout": "dp=4"}]
    for step in range(1, steps + 1):
        compute, comm, bubble, data = 0.5, 0.2 + 0.01 * step, 0.1, 0.02
        records.append({
            "step": step, "kind": "train", "loss": 8.0 - 0.1 * step, "tokens_per_s": 1000.0 + step, "mfu": 0.3,
            "step_time_s": compute + comm + bubble + data, "compute_s": compute, "comm_s": comm,
            "comm_all_reduce_s": comm * 0.75, "comm_p2p_s": comm * 0.25, "bubble_s": bubble, "data_wait_s": data,
            "mem_params_bytes": 4e6, "mem_grads_bytes": 4e6, "mem_optimizer_bytes": 8e6, "mem_rss_bytes": 3e8,
        })  # fmt: skip
        if step % 5 == 0:
            records.append({"step": step, "kind": "eval", "loss": 8.1 - 0.1 * step})
            records.append({
                "step": step, "kind": "ranks", "n_ranks": 4, "compute_s_min": 0.4, "compute_s_median": 0.5,
                "compute_s_max": 0.9 if step == 10 else 0.55, "straggler_rank": 3 if step == 10 else -1,
            })  # fmt: skip
    return records


def test_report_of_a_full_run_embeds_every_plot(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", _synthetic_records())
    page = build_report(run).read_text()
    assert (run / "report.html").is_file()
    images = _images(page)
    assert len(images) == len(ALL_PLOTS) and all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in images)
    for title in ALL_PLOTS:
        assert f"<h2>{title}</h2>" in page
    assert "Not logged" not in page
    assert "9.9.9-test" in page and "dp=4" in page  # environment from the env record
    assert "rank 3" in page  # the straggler, in the summary
    summary = page.split("<h2>Loss")[0]
    assert "comm_all_reduce" in summary and "comm_p2p" in summary  # the breakdown shares, per kind
    assert re.search(r"(src|href)=['\"](?!data:)", page) is None  # nothing to fetch: self-contained


def test_report_degrades_for_a_run_without_the_new_metrics(tmp_path: Path) -> None:
    old = [{"step": s, "kind": "train", "loss": 5.0 / s, "step_time_s": 1.0, "tokens_per_s": 512.0} for s in (1, 2, 3)]
    run = _write_run(tmp_path / "old", old, config='[parallel]\nlayout = "dp=2"\n')
    page = build_report(run, tmp_path / "old.html").read_text()
    assert len(_images(page)) == 2  # loss, throughput
    assert "Not logged in this run: MFU, Time breakdown, Memory, Ranks." in page
    assert "dp=2" in page  # environment falls back to the config


def test_report_of_a_real_short_run(small_run: list[str], tmp_path: Path) -> None:
    cfg = load_config(None, parse_overrides([*small_run, "--train.steps", "5", "--log.every", "1"]))
    result = train(cfg)
    page = build_report(result.run_dir).read_text()
    assert len(_images(page)) >= 2
    assert "final train loss" in page and "[model]" in page  # the summary and the config


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers())
    assert run_report(parser.parse_args(["report", str(tmp_path / "nowhere")])) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    run = _write_run(tmp_path / "run", _synthetic_records(3))
    assert run_report(parser.parse_args(["report", str(run), "--out", str(tmp_path / "r.html")])) == 0
    assert (tmp_path / "r.html").is_file()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = build_report(_write_run(tmp_path / "run", _synthetic_records()))
    shot = tmp_path / "shot.png"
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
               "--window-size=1000,2400", page.as_uri()]  # fmt: skip
    subprocess.run(command, capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 50_000  # text alone would be a few KB: the plots were drawn
