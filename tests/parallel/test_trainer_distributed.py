"""The real trainer on several gloo ranks: same losses as one process, per-rank metrics aggregated,
and checkpoints that resume under another layout."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from distributed import run_shared
from equivalence import trainer_runs

from meshlm.config import load_config, parse_overrides
from meshlm.data import prepare_data
from meshlm.model import Transformer
from meshlm.parallel.transforms.lora import apply_lora
from meshlm.train.trainer import train

STEPS = 4


def _overrides(small_run: list[str], run_dir: Path, layout: str, *extra: str) -> list[str]:
    return [*small_run, "--log.run_dir", str(run_dir), "--parallel.layout", layout, "--train.steps", str(STEPS),
            "--train.eval_every", str(STEPS), "--log.aggregate_every", "2", *extra]  # fmt: skip


def test_layouts_match_single_process_and_log_rank_metrics(small_run: list[str], tmp_path: Path) -> None:
    cfg = load_config(None, parse_overrides(small_run))
    prepare_data(cfg.data, cfg.model.build().vocab_size)  # tokenize once, before the ranks start
    reference = train(load_config(None, parse_overrides(_overrides(small_run, tmp_path / "ref", ""))))

    runs = {
        "dp=2 zero=1": _overrides(small_run, tmp_path / "dp", "dp=2", "--parallel.zero", "1"),
        "tp=2 sp": _overrides(small_run, tmp_path / "tp", "tp=2", "--parallel.sequence_parallel", "true"),
        "pp=2": _overrides(small_run, tmp_path / "pp", "pp=2", "--train.micro_batch", "2"),
        # resume the dp=2 zero=1 run's final weights for two more steps under tp=2 (weights reshard on load)
        "resume tp=2": _overrides(small_run, tmp_path / "dp", "tp=2", "--train.steps", str(STEPS + 2)),
    }
    results = dict(zip(runs, run_shared(trainer_runs, 2, list(runs.values()), timeout=400)[0], strict=True))
    for name in ("dp=2 zero=1", "tp=2 sp", "pp=2"):
        assert results[name]["losses"] == pytest.approx(reference.losses, rel=1e-5), name
        assert results[name]["eval"][-1][1] == pytest.approx(reference.eval_losses[-1][1], rel=1e-5), name
    assert results["resume tp=2"]["start"] == STEPS and len(results["resume tp=2"]["losses"]) == 2

    records = [json.loads(line) for line in (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()]
    ranks = [r for r in records if r["kind"] == "ranks"]
    assert [r["step"] for r in ranks] == [2, 4] and all(r["n_ranks"] == 2 for r in ranks)
    train_records = [r for r in records if r["kind"] == "train"]
    for r in train_records:
        parts = r["compute_s"] + r["comm_s"] + r["bubble_s"] + r["data_wait_s"]
        assert parts == pytest.approx(r["step_time_s"], rel=1e-6)
        assert r["comm_s"] > 0  # tensor parallel's all-reduces are timed as exposed communication


def _printed(runs: list[list[str]]) -> list[str]:
    """What `meshlm train` prints (rank 0 prints, the others nothing), once per list of overrides."""
    out = []
    for overrides in runs:
        with contextlib.redirect_stdout(io.StringIO()) as text:
            train(load_config(None, parse_overrides(overrides)))
        out.append(text.getvalue())
    return out


def test_startup_summary_counts_the_whole_model_under_lora_zero3_and_tp(small_run: list[str], tmp_path: Path) -> None:
    """The summary's total and trainable parameters are the whole model's, as one process builds it, not the
    trainable part only (LoRA) nor this rank's shard (ZeRO-3, tp)."""
    one_step = ["--train.steps", "1", "--train.eval_every", "0", "--checkpoint.every", "0"]
    lora = ["--lora.rank", "4"]
    runs = {
        "dp=2 zero=3 lora": [*small_run, *one_step, *lora, "--parallel.layout", "dp=2", "--parallel.zero", "3",
                             "--log.run_dir", str(tmp_path / "zero3")],
        "tp=2": [*small_run, *one_step, "--parallel.layout", "tp=2", "--log.run_dir", str(tmp_path / "tp")],
    }  # fmt: skip
    printed = dict(zip(runs, run_shared(_printed, 2, list(runs.values()), timeout=400)[0], strict=True))
    model_cfg = load_config(None, parse_overrides(small_run)).model.build()
    plain = Transformer(model_cfg)
    adapted = Transformer(model_cfg)
    apply_lora(adapted, 4)
    for name, model in (("dp=2 zero=3 lora", adapted), ("tp=2", plain)):
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        counts = re.search(r"; parameters: ([\d,]+) total, ([\d,]+) trainable$", printed[name], re.MULTILINE)
        assert counts, printed[name]
        assert [int(n.replace(",", "")) for n in counts.groups()] == [total, trainable], name
    assert (
        0 < sum(p.numel() for p in adapted.parameters() if p.requires_grad) < sum(p.numel() for p in plain.parameters())
    )
