"""`meshlm plan --model` takes a preset, a meshlm TOML run config, or a Hugging Face config.json (file or
folder, read by meshlm's own importer); the launch files then select the same model in `meshlm train`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from meshlm.config import load_config, parse_overrides
from meshlm.model.config import PRESETS
from meshlm.model.hf_export import hf_config_from_model
from meshlm.plan import PlannerError
from meshlm.plan.cli import add_plan_parser, resolve_model, run_plan


def plan_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    assert run_plan(parser.parse_args(["plan", *argv, "--json", "--top", "1"])) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_a_run_config_brings_its_shape_batch_and_length(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(
        '[model]\npreset = "test"\nn_layers = 6\n\n[data]\nseq_len = 32\n\n[train]\nglobal_batch = 12\nsteps = 5\n'
    )
    source = resolve_model(str(path))
    assert source.model == PRESETS["test"].replace(n_layers=6) and source.train_args == ("--config", str(path))
    out = plan_json(capsys, "--model", str(path), "--gpu", "cpu", "--gpus", "2")
    assert (out["model"], out["seq_len"], out["global_batch"], out["train_tokens"]) == ("exp", 32, 12, 5 * 12 * 32)
    assert plan_json(capsys, "--model", str(path), "--gpu", "cpu", "--gpus", "2", "--seq-len", "16")["seq_len"] == 16


@pytest.mark.parametrize("as_folder", [False, True], ids=["file", "folder"])
def test_an_hf_config_plans_the_same_model_as_its_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture, as_folder: bool
) -> None:
    model = PRESETS["llama3-8b"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(model)))
    source = resolve_model(str(tmp_path if as_folder else tmp_path / "config.json"))
    assert source.model == model
    # the launch files select it in `meshlm train` with --model.* overrides, which build the same shape
    assert load_config(overrides=parse_overrides(list(source.train_args))).model.build() == model
    argv = ("--gpus", "8", "--seq-len", "4096", "--global-batch", "64")
    by_file = plan_json(capsys, "--model", str(tmp_path), *argv)["plans"][0]
    by_preset = plan_json(capsys, "--model", "llama3-8b", *argv)["plans"][0]
    assert by_file["tokens_per_s"] == by_preset["tokens_per_s"] and by_file["layout"] == by_preset["layout"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "file {path} not found"),
        ("{not json", "not readable JSON"),
        ("[1, 2]", "expected a JSON object"),
        ("hidden_act", "hidden_act='gelu' is not supported by meshlm (needs 'silu')"),
    ],
    ids=["missing", "not-json", "not-object", "unsupported"],
)
def test_a_bad_model_file_is_one_line_naming_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "config.json"
    if content == "hidden_act":
        content = json.dumps(hf_config_from_model(PRESETS["test"]) | {"hidden_act": "gelu"})
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlannerError) as error:
        resolve_model(str(path))
    text = str(error.value)
    assert text.startswith(f"--model {path}") and message.format(path=path) in text and "\n" not in text


def test_anything_else_lists_what_model_accepts() -> None:
    with pytest.raises(
        PlannerError, match=r"not a preset \(tiny, test, .*\), a meshlm \.toml run config, or a Hugging"
    ):
        resolve_model("README.md")


def test_a_mistral_window_shorter_than_the_sequence_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mistral = PRESETS["test"].replace(hf_model_type="mistral", sliding_window=32)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(mistral)))
    assert plan_json(capsys, "--model", str(tmp_path), "--gpu", "cpu", "--gpus", "2", "--seq-len", "32")["plans"]
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    argv = ["plan", "--model", str(tmp_path), "--gpu", "cpu", "--gpus", "2", "--seq-len", "33"]
    assert run_plan(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "--seq-len 33 exceeds" in err and "sliding_window 32" in err and err.count("\n") == 1
