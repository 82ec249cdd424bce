"""The fuzz findings of issue 49, each now one line naming the field or file, exit 2 (or a said no-op).

Mutations (each measured): without meshlm.data.sources.check_cache_dir the cache_dir cases end in a
FileExistsError / NotADirectoryError traceback; without special_kind the FIFO is "not found", and a FIFO
inside a source folder blocks the read forever (the folder test then times out); without refuse_bool
`zero = true` trains ZeRO-1 and every number field takes true as 1; without CheckpointFolders.refuse_foreign
the symlinked step_N is moved aside as a corrupt checkpoint and the run trains on (the foreign link renamed);
without the "nothing to do" line the resume past train.steps prints nothing about it; convert returned 1
for bad input.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlm.cli import main
from meshlm.config import Config, ConfigError, load_config, parse_overrides
from meshlm.errors import InputError
from meshlm.parallel.options import LoRAOptions, ParallelOptions

TRAIN = ["--train.eval_every", "0", "--checkpoint.every", "2"]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_refused(code: int, err: str, *names: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert all(name in lines[0] for name in names), (lines[0], names)
    assert "Traceback" not in err


# ---- data.cache_dir and data.source ---------------------------------------------------------------------
def test_cache_dir_naming_a_file_or_under_one_is_one_line(
    small_run: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for cache, words in [(a_file, "is not a folder"), (a_file / "sub", f"lies under {a_file}, which is not")]:
        for command in (["train", *small_run], ["prepare-data", *small_run]):
            code, _, err = run_main([*command, "--data.cache_dir", str(cache)], capsys)
            assert_refused(code, err, f"data.cache_dir: {cache}", words, "valid: a folder")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_fifo_corpus_is_named_as_one(
    small_run: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    code, _, err = run_main(["train", *small_run, "--data.source", str(fifo)], capsys)
    assert_refused(code, err, f"data.source: {fifo} is a named pipe (FIFO)", "valid: 'stdlib', a .txt/.jsonl file")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    os.mkfifo(folder / "b.txt")  # reading it would block for ever
    code, _, err = run_main(["prepare-data", *small_run, "--data.source", str(folder)], capsys)
    assert_refused(code, err, f"data.source: {folder / 'b.txt'} is a named pipe (FIFO), not a file")


# ---- true / false for a number --------------------------------------------------------------------------
def test_zero_true_is_refused_in_toml_overrides_and_the_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[parallel]\nzero = true\n")
    line = "parallel.zero: Input should be an integer, not true"
    for args in (["config", "show", "--config", str(config)], ["config", "show", "--parallel.zero", "true"]):
        code, _, err = run_main(args, capsys)
        assert_refused(code, err, line)
    with pytest.raises(InputError, match=line):
        ParallelOptions.of({"zero": True})  # the library's message is the config's, word for word
    with pytest.raises(InputError, match=r"lora\.rank: Input should be an integer, not false"):
        LoRAOptions(rank=False)
    assert load_config(None, parse_overrides(["--parallel.zero", "1"])).parallel.zero == 1  # a number still is


SECTIONS = {name: field.annotation.model_fields for name, field in Config.model_fields.items()}
NUMBER_FIELDS = [
    (section, name)
    for section, fields in SECTIONS.items()
    for name, field in fields.items()
    if {int, float} & {field.annotation, *getattr(field.annotation, "__args__", ())}
    and bool not in {field.annotation, *getattr(field.annotation, "__args__", ())}
]


@given(field=st.sampled_from(NUMBER_FIELDS), value=st.booleans())
def test_no_number_field_takes_a_bool(field: tuple[str, str], value: bool) -> None:
    section, name = field
    with pytest.raises(ConfigError, match=rf"^config error: {section}\.{name}: Input should be an? \w+, not "):
        load_config(None, [(f"{section}.{name}", value)])


def test_number_fields_are_found() -> None:
    assert ("parallel", "zero") in NUMBER_FIELDS and ("train", "lr") in NUMBER_FIELDS and len(NUMBER_FIELDS) > 30


# ---- checkpoints/ and train.steps -----------------------------------------------------------------------
def test_a_foreign_symlink_named_step_n_is_refused_at_start(
    small_run: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    elsewhere = tmp_path / "someone-elses"
    (elsewhere / "data").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir(parents=True)
    link = run_dir / "checkpoints" / "step_00000002"
    link.symlink_to(elsewhere)
    code, _, err = run_main(["train", *small_run, *TRAIN, "--train.steps", "2"], capsys)
    assert_refused(code, err, f"{link} is a symbolic link to {elsewhere}", "move it out of")
    assert link.is_symlink() and (elsewhere / "data").is_dir()  # untouched
    link.unlink()
    link.write_text("a file")
    code, _, err = run_main(["train", *small_run, *TRAIN, "--train.steps", "2"], capsys)
    assert_refused(code, err, f"{link} is not a folder")


def test_a_resume_past_train_steps_says_there_is_nothing_to_do_and_converts_exit_2(
    small_run: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 0: the run is past its target, as a finished run restarted by a scheduler (a requeue after the
    last save) is; an error there would mark a completed job failed. The line says it, once."""
    assert main(["train", *small_run, *TRAIN, "--train.steps", "4"]) == 0
    code, out, _ = run_main(["train", *small_run, *TRAIN, "--train.steps", "2"], capsys)
    assert code == 0 and out.count("run already at step 4 >= train.steps 2: nothing to do") == 1, out
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_00000002", "step_00000004"]
    # convert: a refused checkpoint is bad input (2, as eval and generate); failing to write the output is 1
    shutil.rmtree(run_dir / "checkpoints" / "step_00000002")
    (run_dir / "checkpoints" / "step_00000004" / "trainer.json").write_text("{}")
    code, _, err = run_main(["convert", "meshlm-to-hf", str(run_dir), str(tmp_path / "hf")], capsys)
    assert_refused(code, err, "trainer.json")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["train", *small_run, *TRAIN, "--train.steps", "2"]) == 0
    code, _, err = run_main(["convert", "meshlm-to-hf", str(run_dir), str(a_file / "hf")], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and str(a_file) in err, err
