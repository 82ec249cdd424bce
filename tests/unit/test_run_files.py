"""Run files written whole or not at all, and the bad inputs around a run told in one line (issue #32):
a run directory that is a file, a resume with another batch stream, a full disk at resume, an unreachable
`hf:` dataset, a damaged tokenizer.json at export, a negative shard size, another model family's config.json;
and in a job, rank 0 alone prints an error every rank met."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from meshlm import cli
from meshlm.checkpoint.store import CheckpointError, StorageError, atomic_write, run_dir_problem
from meshlm.config import DataSection, load_config, parse_overrides
from meshlm.data.sources import DataError, iter_documents
from meshlm.model.hf import model_config_from_hf
from meshlm.model.pretrained import check_run_tokenizer
from meshlm.observe.metrics import MetricsLogger
from meshlm.train.trainer import train


def _no_space(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_atomic_write_leaves_the_old_file_whole_when_the_disk_is_full(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "config.toml"
    atomic_write(path, "[train]\nsteps = 8\n")
    assert path.read_text() == "[train]\nsteps = 8\n"
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, "[train]\nsteps = 9\n" * 1000)
    assert path.read_text() == "[train]\nsteps = 8\n"  # not truncated, not half of the new one
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no temporary file left behind


def _run(small_run: list[str], *extra: str) -> object:
    return load_config(None, parse_overrides([*small_run, "--train.eval_every", "0", *extra]))


def test_resume_on_a_full_disk_keeps_config_toml_and_says_so_in_one_line(small_run: list[str], monkeypatch) -> None:
    cfg = _run(small_run, "--train.steps", "2", "--checkpoint.every", "2")
    train(cfg)
    config = Path(cfg.log.run_dir) / "config.toml"
    before = config.read_text()
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(
        StorageError, match=r"run directory cannot be written: .*config\.toml.*: no space left on device"
    ):
        train(_run(small_run, "--train.steps", "4", "--checkpoint.every", "2"))
    assert config.read_text() == before  # the resume did not leave a truncated config for `meshlm eval`


@pytest.mark.parametrize(
    ("override", "words"),
    [(("--train.global_batch", "16"), "train.global_batch = 8, this run has 16"),
     (("--train.seed", "7"), "train.seed = 1234, this run has 7"),
     (("--data.seq_len", "32"), "data.seq_len = 64, this run has 32")],
    ids=["global_batch", "seed", "seq_len"],
)  # fmt: skip
def test_resume_with_another_batch_stream_names_the_field(
    small_run: list[str], override: tuple[str, str], words: str
) -> None:
    train(_run(small_run, "--train.steps", "2", "--checkpoint.every", "2"))
    with pytest.raises(CheckpointError, match=f"step_00000002 was saved with {words}: resume with the run's own"):
        train(_run(small_run, "--train.steps", "4", "--checkpoint.every", "2", *override))


def test_run_dir_that_is_a_file_is_one_line(small_run: list[str], tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(StorageError) as caught:
        train(_run(small_run, "--log.run_dir", str(file)))
    assert str(caught.value) == (
        f"log.run_dir {file}: is a file, not a directory; give a directory this process can create and write"
    )


def test_read_only_run_dir_names_the_field_the_same_on_every_rank(tmp_path: Path) -> None:
    """The same words whichever rank's file failed (each rank opens its own stacks file), so rank 0's line
    says it for all; running as root, a read-only mount cannot be made here, so the errno is given."""
    error = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "stacks" / "rank3.txt"))
    assert run_dir_problem(tmp_path, error) == (
        f"log.run_dir {tmp_path}: read-only file system; give a directory this process can create and write"
    )


def test_tensorboard_on_a_full_disk_is_one_line(tmp_path: Path, monkeypatch) -> None:
    import torch.utils.tensorboard

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _no_space)
    with pytest.raises(StorageError, match=r"metrics cannot be written: .*tensorboard: no space left on device"):
        MetricsLogger(tmp_path, tensorboard=True)


def test_unreachable_hf_dataset_is_one_line(monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")

    def unreachable(*_args: object, **_kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'nobody/none' on the Hub (LocalEntryNotFoundError)\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as caught:
        next(iter_documents(DataSection(source="hf:nobody/none")))
    assert str(caught.value).startswith(
        "data.source: hf:nobody/none (split 'train') cannot be loaded: Couldn't reach 'nobody/none' on the Hub "
        "(LocalEntryNotFoundError); valid: "
    )
    assert "\n" not in str(caught.value)


def test_export_refuses_a_damaged_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab"')
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a loadable tokenizer \("):
        check_run_tokenizer(tmp_path)


def test_negative_max_shard_bytes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["convert", "meshlm-to-hf", "run", "out", "--max-shard-bytes", "-5"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "meshlm convert meshlm-to-hf: error: argument --max-shard-bytes: expected an integer from 1 to "
        f"{2**63 - 1}, got '-5' (see meshlm convert meshlm-to-hf -h)"
    ]


def test_another_family_config_names_model_type() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}
    with pytest.raises(ValueError, match=r"^config.json: model_type='gpt2' is not supported by meshlm \(needs 'llama'"):
        model_config_from_hf(gpt2)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_error_every_rank_meets_is_printed_by_rank_0_only(
    rank: str, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", rank)
    assert cli.main(["config", "show", "--train.steps", "-1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == (1 if rank == "0" else 0), lines
    assert all(line.startswith("meshlm: config error: train.steps:") for line in lines)
