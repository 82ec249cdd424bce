"""The single-process trainer: learning happens, resume equals uninterrupted, and bad layouts stop early."""

import argparse
import math
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint import CheckpointError, list_checkpoints, load_model_state
from meshlm.checkpoint.store import RunDirInUse, RunLock
from meshlm.cli import main
from meshlm.config import load_config, parse_overrides
from meshlm.parallel.mesh import LayoutError
from meshlm.train.trainer import train


def _cfg(small_run: list[str], *extra: str):
    return load_config(None, parse_overrides([*small_run, *extra]))


def test_resume_equals_uninterrupted(small_run: list[str]) -> None:
    cfg = _cfg(small_run, "--train.steps", "8", "--checkpoint.every", "4", "--train.eval_every", "0")
    full = train(cfg)
    run = Path(cfg.log.run_dir)
    final_weights = load_model_state(list_checkpoints(run)[-1])
    assert [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000008"]

    shutil.rmtree(list_checkpoints(run)[-1])  # as if the job died after step 4's checkpoint
    resumed = train(cfg)
    assert resumed.start_step == 4 and resumed.final_step == 8
    assert resumed.losses == full.losses[4:]  # bitwise: same batches, same optimizer state
    resumed_weights = load_model_state(list_checkpoints(run)[-1])
    for name, tensor in final_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name


def test_finished_run_does_nothing_more(small_run: list[str]) -> None:
    cfg = _cfg(small_run, "--train.steps", "2", "--train.eval_every", "0")
    train(cfg)
    again = train(cfg)
    assert again.losses == [] and again.final_step == 2


def test_gradient_accumulation_matches_full_batch(small_run: list[str], tmp_path: Path) -> None:
    a = train(_cfg(small_run, "--train.steps", "4", "--train.eval_every", "0", "--log.run_dir", str(tmp_path / "a")))
    b = train(
        _cfg(small_run, "--train.steps", "4", "--train.eval_every", "0", "--train.micro_batch", "2",
             "--log.run_dir", str(tmp_path / "b"))
    )  # fmt: skip
    assert b.losses == pytest.approx(a.losses, rel=1e-5)


@pytest.mark.slow  # 40 steps and evaluations on real text: ~19 s
def test_short_default_run_lowers_validation_loss(small_run: list[str]) -> None:
    """The demo's model (tiny preset, 512-token vocabulary) on real Python source: 40 steps take the
    validation loss from ln(vocab) down by more than a nat."""
    cfg = _cfg(
        small_run, "--model.preset", "tiny", "--model.vocab_size", "512", "--data.seq_len", "128",
        "--train.steps", "40", "--train.eval_every", "40", "--train.warmup_steps", "5", "--checkpoint.every", "0",
    )  # fmt: skip
    result = train(cfg)
    (_, first), (_, last) = result.eval_losses[0], result.eval_losses[-1]
    assert first == pytest.approx(math.log(512), abs=0.2)  # an untrained model
    assert last < first - 1.0


def test_world_size_layout_mismatch_fails_before_any_work(small_run: list[str]) -> None:
    cfg = _cfg(small_run, "--parallel.layout", "tp=2")
    with pytest.raises(LayoutError, match="pp×cp×tp = 2 does not divide the world size 1"):
        train(cfg)
    assert not Path(cfg.log.run_dir).exists()


def test_run_directory_converts_to_hugging_face(small_run: list[str], tmp_path: Path) -> None:
    from meshlm.cli import add_convert_parser
    from meshlm.convert import run_convert
    from meshlm.model.hf import load_hf_into_model

    cfg = _cfg(small_run, "--train.steps", "2", "--train.eval_every", "0")
    train(cfg)
    parser = argparse.ArgumentParser(prog="meshlm")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    assert run_convert(parser.parse_args(["convert", "meshlm-to-hf", cfg.log.run_dir, str(tmp_path / "hf")])) == 0
    exported = load_hf_into_model(tmp_path / "hf").state_dict()
    for name, tensor in load_model_state(list_checkpoints(Path(cfg.log.run_dir))[-1]).items():
        assert torch.equal(exported[name], tensor), name


def test_checkpoint_of_another_model_is_refused_naming_the_field(small_run: list[str]) -> None:
    train(_cfg(small_run, "--train.steps", "2", "--train.eval_every", "0"))
    with pytest.raises(CheckpointError, match=r"is for another model \(model\.dim: checkpoint 64, config 128\)"):
        train(_cfg(small_run, "--train.steps", "4", "--train.eval_every", "0", "--model.dim", "128"))


def test_one_job_per_run_directory(small_run: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory whose lock a live job holds refuses a second job in one line naming log.run_dir and the
    holder, before any work; the lock is released when a job ends, and a crashed job's lock (the file names a
    holder, yet the kernel dropped the lock with its process) is taken over with a line."""
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    holder = RunLock(run_dir)
    assert holder.acquire() is None
    with pytest.raises(RunDirInUse, match=r"^log.run_dir: .* is in use by another job \(pid \d+ on host "):
        RunLock(run_dir).acquire()
    assert main(["train", *small_run, "--train.steps", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"meshlm: log.run_dir: {run_dir} is in use by another job (pid "), line
    assert not list_checkpoints(run_dir)
    holder.release()

    (run_dir / "job.lock").write_text("pid 4242 on host gone\n")  # what a crash leaves: a name, no lock
    assert main(["train", *small_run, "--train.steps", "1", "--train.eval_every", "0"]) == 0
    out = capsys.readouterr().out
    assert (
        f"{run_dir / 'job.lock'}: taken over from a job that ended without releasing it (pid 4242 on host gone)" in out
    )
    assert (run_dir / "job.lock").read_text() == ""  # released at the end
    assert RunLock(run_dir).acquire() is None
