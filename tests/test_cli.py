"""The real `meshlm` entry point, run as a subprocess the way a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.checkpoint import list_checkpoints


def meshlm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_config_show_prints_resolved_toml() -> None:
    out = meshlm("config", "show", "--train.steps", "7", "--parallel.layout", "dp=2")
    assert out.returncode == 0, out.stderr
    assert "[train]\nsteps = 7\n" in out.stdout and 'layout = "dp=2"' in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.lr", "-1"], "config error: train.lr: Input should be greater than 0"),
        (["--model.preset", "gpt5"], "config error: model.preset: unknown preset 'gpt5'"),
        (["--parallel.layout", "tp=2"], "pp×tp = 2 does not divide the world size 1"),
        (["--parallel.layout", "xp=1"], "unknown dimension 'xp'"),
        (["--config", "missing.toml"], "config error: file missing.toml not found"),
        (["--data.source", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str, tmp_path: Path) -> None:
    out = meshlm("train", *args, "--log.run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_eval_generate_through_the_entry_point(small_run: list[str]) -> None:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    out = meshlm("train", *small_run, "--train.steps", "6", "--train.eval_every", "3")
    assert out.returncode == 0, out.stderr
    assert "validation loss" in out.stdout
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000006"]
    assert (run_dir / "metrics.jsonl").read_text().count('"kind": "eval"') == 3

    out = meshlm("eval", str(run_dir), "--batches", "2")
    assert out.returncode == 0, out.stderr
    assert "step_00000006: validation loss" in out.stdout

    out = meshlm("generate", str(run_dir), "--prompt", "import os\n", "--max-new-tokens", "12", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os\n") and len(out.stdout) > len("import os\n")


def test_eval_of_a_directory_without_run_is_a_clear_error(tmp_path: Path) -> None:
    out = meshlm("eval", str(tmp_path))
    assert out.returncode == 2
    assert "config.toml not found" in out.stderr


def test_train_under_torchrun(small_run: list[str]) -> None:
    """The same command on two ranks launched by torchrun (data parallel with ZeRO-1)."""
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "meshlm.cli", "train", *small_run, "--train.steps", "3", "--train.eval_every", "3",
         "--parallel.layout", "dp=2", "--parallel.zero", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("validation loss") == 1  # printed by rank 0 only
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003"]
    assert '"layout": "pp=1,dp=2,tp=1"' in (run_dir / "metrics.jsonl").read_text()
