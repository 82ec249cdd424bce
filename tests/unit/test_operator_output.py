"""What `meshlm train` prints for an operator when stdout is not a terminal (a batch job): the data line before
tokenizing, the start-up summary (model, layout, batch, tokens/step, data, checkpoints, what resumed), plain
progress lines; and the saved config's absolute `data.cache_dir`, so `meshlm eval/generate RUN` from another
directory finds the token cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from run_args import small_run_args

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.model import Transformer


@pytest.mark.slow  # two short training runs in this process, after the session's tokenization: ~15-45 s
def test_a_batch_job_log_has_a_summary_plain_progress_and_an_absolute_cache(
    data_cache: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    args = small_run_args(os.path.relpath(data_cache, tmp_path), Path("run"))  # relative, as in configs/
    args += ["--log.progress", "true", "--log.every", "2", "--train.eval_every", "0", "--checkpoint.every", "2",
             "--checkpoint.async_save", "false"]  # fmt: skip
    assert main(["train", *args, "--train.steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"data: stdlib (token cache {data_cache}; tokenized once, then reused)" in out
    assert out.count("data: ") == 1  # the line before tokenizing; the summary says the corpus size
    assert (
        "layout: pp=1,dp=1,tp=1 on 1 ranks (cpu), zero 0, schedule 1f1b, recompute none, dtype fp32, compile off, "
        "fused loss on" in out
    )
    assert "batch: 8 × 64 tokens = 512 tokens/step, micro-batch whole, 2 steps" in out
    assert "checkpoints: run every 2 steps; fresh start at step 0" in out and "model: test, " in out
    test_model = load_config(None, [("model.preset", "test"), ("data.seq_len", 64)]).model.build()
    params = sum(p.numel() for p in Transformer(test_model).parameters())
    assert f"; parameters: {params:,} total, {params:,} trainable" in out
    corpus = re.search(r"^corpus: ([\d,]+) train and ([\d,]+) validation tokens$", out, re.MULTILINE)
    assert corpus and min(int(n.replace(",", "")) for n in corpus.groups()) > 0, out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"] and " ETA 0:00:00" in progress[-1]
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.data.cache_dir == data_cache  # absolute: eval/generate from anywhere reuse it

    assert main(["train", *args, "--train.steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: run every 2 steps; resumed from run/checkpoints/step_00000002 at step 2" in out, out
    reshaped = [line for line in out.splitlines() if "schedule" in line and "reshaped" in line]
    assert reshaped == [
        "warning: train.steps 4 (was 2): the learning-rate schedule is reshaped from step 2 on (resume with the "
        "checkpoint's values to keep it)"
    ], out
