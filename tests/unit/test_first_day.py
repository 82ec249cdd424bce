"""What a first day with meshlm meets (issue 49): the `tiny` preset is the demo's model everywhere (train, plan,
config show), `generate` says which checkpoint it used, reads the run's own tokenizer (refusing a damaged one)
and with `--chat` wraps the prompt in the run's chat template; the start-up line names a resized preset as
resized, a checkpoint of another model points at a new run directory, `train --help` is short, and a run report
with one logged step explains its missing plots instead of drawing empty frames.

Mutations (each makes its test fail): `"tiny": ModelConfig()` (vocab 2048) in meshlm/model/config.py; the
start-up line's `model_name` back to `cfg.model.preset`; the `--log.run_dir` hint removed from `another_model`;
`generate` through the data cache's tokenizer (the old path) instead of the run's; `--chat` ignored
(`Prompter.encode(text)` for every prompt); the train parser's epilog back to `reference_help()`; the report's
`steps_drawn` check removed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from sft_data import CHATML, hf_tokenizer_dir
from tokenizers import Tokenizer

from meshlm.cli import main
from meshlm.config import Config, load_config
from meshlm.data.generation import Prompter
from meshlm.data.sft import ChatTemplate, PlainTemplate
from meshlm.model import PRESETS
from meshlm.model.flops import param_counts
from meshlm.observe.report import build_report
from meshlm.plan.cli import resolve_model

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tiny.toml"


def test_the_tiny_preset_is_the_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo`'s config, the default `meshlm train`, every shipped config and `plan --model tiny` build one
    model (3,164,416 parameters, 512 tokens), and `config show` says so."""
    demo = load_config(DEMO).model.build()
    assert demo == PRESETS["tiny"] == load_config(None).model.build() == resolve_model("tiny").model
    for config in sorted((ROOT / "configs").glob("*.toml")):
        assert load_config(config).model.build() == demo, config.name
    assert (demo.vocab_size, param_counts(demo)["total"]) == (512, 3_164_416)
    assert main(["config", "show", "--config", str(DEMO)]) == 0
    assert "\n# model: 512-token vocabulary, 3,164,416 parameters\n" in capsys.readouterr().out


def _one_step(data_cache: str, run_dir: Path) -> list[str]:
    from run_args import small_run_args

    return [*small_run_args(data_cache, run_dir), "--train.steps", "1", "--train.eval_every", "0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    """A 1-step run of the `test` preset (a few seconds)."""
    run_dir = tmp_path_factory.mktemp("first-day") / "run"
    assert main(["train", *_one_step(data_cache, run_dir)]) == 0
    return run_dir


def test_start_up_line_and_another_models_checkpoint(
    data_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The start-up line names the preset, or the preset resized with the fields that differ; resuming a run
    directory with another model is one line that points at a new run directory (--log.run_dir)."""
    args = _one_step(data_cache, tmp_path / "run")
    assert main(["train", *args]) == 0
    assert re.search(r"^model: test, [\d.]+ TFLOP/step", capsys.readouterr().out, re.M)
    assert main(["train", *args, "--model.dim", "128"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is for another model (model.dim: checkpoint 64, config 128); train the new model in a new run " in line
    assert "(--log.run_dir), or resume this one with model.dim = 64" in line
    other = ["--log.run_dir", str(tmp_path / "wide"), "--model.dim", "128", "--model.n_layers", "2"]
    assert main(["train", *args, *other]) == 0
    assert re.search(r"^model: test resized: dim 128, n_layers 2, [\d.]+ TFLOP/step", capsys.readouterr().out, re.M)


def test_generate_names_its_checkpoint_and_refuses_a_damaged_tokenizer(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--prompt", "def f(", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert err == f"meshlm generate: {run_dir / 'checkpoints' / 'step_00000001'}\n" and out.startswith("def f(")
    damaged = run_dir.parent / "damaged"  # the same run, its tokenizer.json cut off
    damaged.mkdir()
    for f in run_dir.iterdir():
        (damaged / f.name).symlink_to(f)
    (damaged / "tokenizer.json").unlink()
    (damaged / "tokenizer.json").write_text('{"model": ')  # cut off mid-write
    assert main(["generate", str(damaged), "--prompt", "def f("]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[1:]
    assert line.startswith(f"meshlm: {damaged / 'tokenizer.json'}: not a valid tokenizer.json ("), line


def _fake_generate(calls: list, reply: list[int]):
    """meshlm.model.generate's stand-in: records the prompt and stop ids, answers `reply` then the last stop id."""

    def generate(model, prompt, max_new_tokens, temperature, top_k, generator, stop):
        calls.append((prompt[0].tolist(), list(stop)))
        return torch.tensor([[*prompt[0].tolist(), *reply, stop[-1]]])

    return generate


def test_generate_chat_wraps_the_prompt_in_the_runs_template(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--chat`: meshlm's own tokenizer gets the plain SFT template's user turn (the tokens training put before
    a response), a tokenizer with a chat template that template's, rendered by transformers; generation stops
    at the end of the turn and the reply alone is printed."""
    pytest.importorskip("transformers")
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    reply = tokenizer.encode(" 6").ids
    calls: list = []
    monkeypatch.setattr("meshlm.model.generate", _fake_generate(calls, reply))
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--chat", "--prompt", "3+3?"]) == 0
    assert capsys.readouterr().out == " 6\n"
    ids, _ = PlainTemplate(tokenizer, eot).encode([("user", "3+3?"), ("assistant", "6")], "x")
    (prompt, stop) = calls[-1]
    assert ids[: len(prompt)] == prompt and tokenizer.decode(prompt) == "user:\n3+3?\nassistant:\n"
    assert stop == [eot]

    chat_run = run_dir.parent / "chat"  # the same checkpoint with a ChatML tokenizer (as an HF init_from keeps it)
    chat_run.mkdir()
    for f in run_dir.iterdir():
        if f.name != "tokenizer.json":
            (chat_run / f.name).symlink_to(f)
    hf_tokenizer_dir(chat_run, CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>")
    chatml = Tokenizer.from_file(str(chat_run / "tokenizer.json"))
    im_end = chatml.token_to_id("<|im_end|>")
    assert main(["generate", str(chat_run), "--chat", "--prompt", "3+3?"]) == 0
    (prompt, stop) = calls[-1]
    assert (
        chatml.decode(prompt, skip_special_tokens=False) == "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    template = ChatTemplate(chat_run / "tokenizer.json", chatml)
    ids, _ = template.encode([("user", "3+3?"), ("assistant", "6")], "x")
    assert ids[: len(prompt)] == prompt  # the tokens training put before the response
    assert stop == [chatml.token_to_id("<|endoftext|>"), im_end]
    assert capsys.readouterr().out.endswith(chatml.decode(reply, skip_special_tokens=False) + "\n")
    assert Prompter(chat_run / "tokenizer.json", 512).encode("3+3?") == chatml.encode("3+3?").ids  # plain: as is


def test_train_help_is_short_and_help_all_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    fields = [f"--{s}.{n} (default " for s, f in Config.model_fields.items() for n in f.annotation.model_fields]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) <= 30 and "--parallel.layout (default " in short and "--help-all" in short
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    full = capsys.readouterr().out
    assert [f for f in fields if f not in full] == []


def test_report_of_one_logged_step_says_why_it_has_no_plots(tmp_path: Path) -> None:
    """One train record (a 1-step run): a line per plot would be a single invisible point, so none is drawn
    and a note says why; two steps draw them."""
    record = {"kind": "train", "loss": 6.2, "tokens_per_s": 900.0, "mfu": 0.1, "step_time_s": 1.0,
              "compute_s": 0.9, "bubble_s": 0.0, "data_wait_s": 0.1, "mem_params_bytes": 4e6}  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, **record}) + "\n")
    page = build_report(run).read_text()
    assert "base64," not in page
    note = "Not plotted: Loss, Throughput, MFU, Time breakdown, Memory (metrics at step 1 only; a curve needs two"
    assert note in page and "Not logged in this run: Ranks." in page
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **record}) + "\n" for s in (1, 2)))
    page = build_report(run).read_text()
    assert page.count("base64,") == 5 and "Not plotted" not in page
