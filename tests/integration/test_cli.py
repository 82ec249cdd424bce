"""The real `meshlm` entry point, run as a subprocess the way a user runs it (and `main` in this process, for
the many one-line error cases: the same code without an interpreter start-up each)."""

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from run_args import small_run_args

from meshlm import InputError
from meshlm.checkpoint import CheckpointError, StorageError, list_checkpoints
from meshlm.cli import main, validation_line
from meshlm.config import ConfigError, load_config
from meshlm.data import DataError
from meshlm.files import sha256_file
from meshlm.observe.metrics import read_metrics
from meshlm.parallel.mesh import LayoutError
from meshlm.parallel.parallel_plan import PlanError
from meshlm.plan import PlannerError


def meshlm(*args: str, cwd: Path | None = None, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-m", "meshlm.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _imported(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_config_show_prints_resolved_toml() -> None:
    """Also: every command builds the whole parser, so what the parser's modules import at their top is paid
    by every `meshlm` process (each rank of a run). Commands that need no tensors (config, plan, report, and
    a config error of any command) start without torch (~2 s), matplotlib or inductor."""
    out = meshlm("config", "show", "--train.steps", "7", "--parallel.layout", "dp=2", flags=("-X", "importtime"))
    assert out.returncode == 0, out.stderr
    assert "[train]\nsteps = 7\n" in out.stdout and 'layout = "dp=2"' in out.stdout
    imported = _imported(out.stderr)
    assert {"meshlm.observe.report", "meshlm.plan.cli"} <= imported
    assert not {"torch", "matplotlib"} & imported


def test_plan_starts_without_torch() -> None:
    plan = meshlm("plan", "--model", "test", "--gpus", "2", "--gpu", "cpu", "--top", "1", flags=("-X", "importtime"))
    assert plan.returncode == 0 and "dp=" in plan.stdout, plan.stderr[-2000:]
    assert "torch" not in _imported(plan.stderr)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.lr", "-1"], "config error: train.lr: Input should be greater than 0"),
        (["--model.preset", "gpt5"], "config error: model.preset: unknown preset 'gpt5'"),
        (["--parallel.layout", "tp=2"], "pp×cp×tp = 2 does not divide the world size 1"),
        (["--parallel.layout", "xp=1"], "unknown dimension 'xp'"),
        (["--config", "missing.toml"], "config error: file missing.toml not found"),
        (["--data.source", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (`main`, what the entry point calls): each case costs no interpreter start-up."""
    code, err = run_main(
        ["train", *args, "--log.run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path)], capsys
    )
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "error", [ConfigError, LayoutError, PlanError, PlannerError, DataError, CheckpointError, StorageError]
)
def test_every_bad_input_error_is_an_input_error_the_cli_prints_as_one_line(
    error: type[Exception], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(_args: object, _extra: object) -> int:
        raise error("what was wrong, and what would be valid")

    monkeypatch.setattr("meshlm.cli.cmd_config_show", fail)
    assert issubclass(error, InputError) and issubclass(error, ValueError)
    assert main(["config", "show"]) == 2
    assert capsys.readouterr().err == "meshlm: what was wrong, and what would be valid\n"


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("train", ["--train.lr", "-1"], "config error: train.lr: Input should be greater than 0"),
        ("train", ["--config", "missing.toml"], "config error: file missing.toml not found"),
        ("train", ["--data.source", "/no/such/corpus.txt"], "data.source: /no/such/corpus.txt not found; valid: "),
        ("prepare-data", ["--data.source", "/no/such/dir/"], "data.source: /no/such/dir/ not found; valid: "),
        ("train", ["--model.init_from", "/no/such/model"], "config error: model.init_from: /no/such/model not found"),
        ("config", ["show", "--model.init_from", "/"], "config error: model.init_from: / is not a checkpoint (no "),
    ],
)
def test_bad_input_through_the_real_entry_point_is_one_line(
    command: str, args: list[str], message: str, tmp_path: Path
) -> None:
    """The same as a user sees it: nothing else (no warning, no traceback) reaches stderr, and the config and
    its data and model.init_from paths are checked before torch is imported (a missing path took 20-100 s to be
    reported)."""
    args = [*args, "--log.run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path)]
    out = meshlm(command, *args, flags=("-X", "importtime"))
    errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert out.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"meshlm: {message}"), errors
    assert "torch" not in _imported(out.stderr)


@pytest.fixture(scope="module")
def trained_run(data_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained through the entry point: 6 steps, evaluated at 0, 3 and 6, one checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    out = meshlm("train", *small_run_args(data_cache, run_dir), "--train.steps", "6", "--train.eval_every", "3")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^validation loss \d\.\d{4} \(step 0\) -> \d\.\d{4} \(step 6\); run directory ", out.stdout, re.M)
    return run_dir


def test_config_show_with_init_from_prints_the_model_the_checkpoint_defines(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not just `preset = "small"` (the default, unused): the fine-tuned model's own fields, as TOML comments."""
    capsys.readouterr()
    assert main(["config", "show", "--model.init_from", str(trained_run), "--data.seq_len", "64"]) == 0
    out = capsys.readouterr().out
    test_model = load_config(None, [("model.preset", "test"), ("data.seq_len", 64)]).model.build()
    assert f"# the model model.init_from {trained_run} defines (model.preset is not used):\n" in out
    assert f"\n#   n_layers = {test_model.n_layers!r}\n" in out and f"\n#   dim = {test_model.dim!r}\n" in out, out
    assert load_config(None, [("model.init_from", str(trained_run)), ("data.seq_len", 64)]).model.build() == test_model
    assert tomllib.loads(out)["model"]["init_from"] == str(trained_run)  # still TOML


def test_the_pipeline_hint_says_to_set_micro_batch() -> None:
    """The default micro_batch (0: the whole per-replica batch) is one micro-batch: "lower" it is no advice."""
    from meshlm.parallel.mesh import parse_layout
    from meshlm.parallel.pp.strategy import check_pipeline_schedule

    with pytest.raises(LayoutError, match=r"got 1 \(set train.micro_batch so that the per-replica batch splits"):
        check_pipeline_schedule(parse_layout("pp=2", 2), 1)


def test_the_validation_line_of_a_resumed_run_reads_sensibly() -> None:
    """A run resumed near its end evaluates once: that loss at its step, not `3.3053 -> 3.3053`."""
    assert validation_line([(6, 3.30531)]) == "validation loss 3.3053 at step 6"
    assert validation_line([(4, 3.4), (6, 3.3)]) == "validation loss 3.4000 (step 4) -> 3.3000 (step 6)"


def test_train_eval_generate_through_the_entry_point(trained_run: Path) -> None:
    assert [p.name for p in list_checkpoints(trained_run)] == ["step_00000006"]
    evals = read_metrics(trained_run, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6]

    out = meshlm("eval", str(trained_run))  # the trainer's own evaluation: the same loss it logged
    assert out.returncode == 0, out.stderr
    assert f"step_00000006: validation loss {evals[-1]['loss']:.4f}" in out.stdout

    out = meshlm(
        "generate", str(trained_run), "--prompt", "import os\n", "--max-new-tokens", "12", "--temperature", "0"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os\n") and len(out.stdout) > len("import os\n")


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("file", "damage", "message"),
    [
        ("__0_0.distcp", truncate, "__0_0.distcp has"),
        (".metadata", flip_a_byte, ".metadata fails its sha256 check"),
        (".metadata", Path.unlink, ".metadata is missing"),
        ("trainer.json", flip_a_byte, "trainer.json fails its sha256 check"),
        ("manifest.json", Path.unlink, "manifest.json is missing"),
    ],
)
def test_a_corrupt_only_checkpoint_is_one_line_for_eval_generate_and_export(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str, damage, message: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    damage(list_checkpoints(run_dir)[-1] / file)
    for args, expected_code in [
        (["eval", str(run_dir)], 2),
        (["generate", str(run_dir)], 2),
        (["convert", "meshlm-to-hf", str(run_dir), str(tmp_path / "hf")], 2),
    ]:
        code, err = run_main(args, capsys)
        assert code == expected_code and len(err.splitlines()) == 1, (args, err)
        assert f"{run_dir}: no valid checkpoint under {run_dir / 'checkpoints'}" in err and message in err, err
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_of_another_model_and_bad_arguments(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace('preset = "test"', 'preset = "test"\nn_layers = 2'))
    code, err = run_main(["eval", str(run_dir)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is for another model (model.n_layers: checkpoint 4, config.toml 2)" in err
    for args, message in [
        (["eval", str(run_dir), "--batches", "0"], "config error: train.eval_batches: Input should be greater than 0"),
        (["generate", str(run_dir), "--top-k", "0"], "argument --top-k: expected an integer from 1 to"),
        (["generate", str(run_dir), "--temperature", "-1"], "argument --temperature: expected a finite number >= 0"),
        (["generate", str(run_dir), "--prompt", ""], "argument --prompt: the prompt must not be empty"),
        (["generate", str(run_dir), "--seed", "1e3"], "argument --seed: expected an integer from 0 to"),
        (["eval", str(run_dir), "--bogus"], "unrecognized arguments: --bogus"),
    ]:
        code, err = run_main(args, capsys)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (args, err)


def drop_weight(checkpoint: Path, name: str) -> None:
    """Make `checkpoint` one that lacks the model weight `name`, still verifying (metadata and manifest agree)."""
    metadata_file = checkpoint / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    del metadata.state_dict_metadata[f"model/{name}"]
    metadata_file.write_bytes(pickle.dumps(metadata))
    manifest_file = checkpoint / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][".metadata"] = {"bytes": metadata_file.stat().st_size, "sha256": sha256_file(metadata_file)}
    manifest_file.write_text(json.dumps(manifest))


def test_a_checkpoint_lacking_a_trained_weight_is_one_line_for_eval_generate_and_export(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run trains every weight (no LoRA, no train.freeze): a checkpoint without one is incomplete, not
    a model to fill from the seeded initial weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    checkpoint = list_checkpoints(run_dir)[-1]
    drop_weight(checkpoint, "model.norm.weight")
    missing = f"{checkpoint}: model weight model.norm.weight is missing"
    refused_by_every_reader(run_dir, tmp_path / "hf", missing, capsys)


def refused_by_every_reader(run_dir: Path, export: Path, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """eval, generate and convert each end in the one line `line` (exit 2 each) and export nothing."""
    for args, expected_code in [
        (["eval", str(run_dir)], 2),
        (["generate", str(run_dir)], 2),
        (["convert", "meshlm-to-hf", str(run_dir), str(export)], 2),
    ]:
        code, err = run_main(args, capsys)
        assert code == expected_code and len(err.splitlines()) == 1, (args, err)
        assert line in err, (args, err)
    assert not export.exists()


class Evil:
    def __reduce__(self) -> tuple:
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def forge(checkpoint: Path, name: str, content: bytes) -> None:
    """Replace checkpoint file `name` and its manifest record: the checksums pass, the content is hostile."""
    (checkpoint / name).write_bytes(content)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(content), "sha256": sha256_file(checkpoint / name)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        pytest.param(
            ".metadata",
            pickle.dumps(Evil()),
            "UnpicklingError: builtins.exec is not a DCP metadata class; refused",
            id="code-in-metadata",
        ),
        pytest.param(
            "__0_0.distcp",
            pickle.dumps({"w": Evil()}),
            "rank 0: EOFError (a file is not what DCP wrote)",
            id="pickle-as-tensor-file",
        ),
    ],
)
def test_a_refused_checkpoint_is_one_line_for_eval_generate_and_export(
    name: str,
    content: bytes,
    reason: str,
    trained_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unpickling attack (code in `.metadata`) or a tensor file that is not weights: refused as `train`
    refuses it (one line, no traceback), and the payload never runs."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    checkpoint = list_checkpoints(run_dir)[-1]
    forge(checkpoint, name, content)
    refused_by_every_reader(run_dir, tmp_path / "hf", f"checkpoint {checkpoint} cannot be loaded: {reason}", capsys)
    assert not (tmp_path / "PWNED").exists()


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


def test_help_lists_every_config_field_and_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`meshlm train --help-all` (and `prepare-data`, `config show`) list every field of the config schema with its
    default (`--help`, the common ones: tests/unit/test_first_day.py); `generate`'s options each have a line of help;
    `meshlm --version` names the package version."""
    from meshlm import __version__
    from meshlm.config import Config

    fields = [f"--{s}.{n} (default " for s, f in Config.model_fields.items() for n in f.annotation.model_fields]
    for command in (["train"], ["prepare-data"], ["config", "show"]):
        with pytest.raises(SystemExit):
            main([*command, "--help-all"])
        out = capsys.readouterr().out
        assert [f for f in fields if f not in out] == [], command
    assert "--fault.max_skips (default 5): under 'skip'" in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed"):
        assert f"{option} " in out and out.split(f"{option} ", 1)[1].split("\n")[0].strip(), option
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"meshlm {__version__}\n"


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`meshlm config reference | head`: the reader leaves early; meshlm exits 0 without BrokenPipeError."""
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "config", "reference"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.close()  # before the interpreter has even started: every write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == "", err
