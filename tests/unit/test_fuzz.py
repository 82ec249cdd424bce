"""No traceback on bad input: generated config TOML, command-line overrides, HF `config.json` fields and
corrupted safetensors files, each through the real entry point. Every outcome is either success or the
meshlm error with one line naming the offending field or file; any other exception fails the test."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlm.cli import main
from meshlm.config import Config, ConfigError, load_config, parse_overrides, to_toml
from meshlm.model.config import ModelConfig
from meshlm.model.hf import model_config_from_hf
from meshlm.model.hf_export import _save_meshlm_file, export_hf, hf_config_from_model
from meshlm.model.llama import Transformer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SECTIONS = {name: field.annotation.model_fields for name, field in Config.model_fields.items()}
# Values a field might plausibly be given, right or wrong: the edges of every range, wrong types, and the
# strings the Literal fields accept (so a valid document is generated often enough to test success too).
WORDS = ["auto", "fp32", "bf16", "cpu", "cuda", "1f1b", "gpipe", "interleaved", "skip", "rollback", "test", "tiny"]
WORDS += ["dp=1", "pp=2,tp=2", "5:7", "0:1", "x", "", "true", "3", "\n", '"', "\\", "\x00", "\x7f", "é"]
SCALARS = st.one_of(
    st.sampled_from([0, 1, -1, 2, 7, 64, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
    st.integers(-(10**4), 10**4),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.2, 1e-8, 1e308, -1.5, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from(WORDS),
    st.text(max_size=6),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=2), st.dictionaries(st.sampled_from(["a", "b"]), SCALARS))
BARE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def toml_value(value: object) -> str:
    """TOML for a generated value (json.dumps strings are TOML basic strings, except DEL, which stays raw
    and makes an invalid document: that is a case too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, object]:
    """{section: {key: value}} (or {section: value}: a section that is not a table), mostly real names."""
    doc: dict[str, object] = {}
    for _ in range(draw(st.integers(1, 3))):
        section = draw(BARE) if draw(st.integers(0, 7)) == 0 else draw(st.sampled_from(list(SECTIONS)))
        if draw(st.integers(0, 9)) == 0:
            doc[section] = draw(SCALARS)
            continue
        known = list(SECTIONS.get(section, {})) or ["x"]
        key = st.text(min_size=1, max_size=4) if draw(st.integers(0, 7)) == 0 else st.sampled_from(known)
        keys = draw(st.lists(key, max_size=3))
        doc[section] = {key: draw(VALUES) for key in keys}
    return doc


def render(doc: dict[str, object]) -> str:
    lines = [f"{section} = {toml_value(body)}" for section, body in doc.items() if not isinstance(body, dict)]
    for section, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"[{section}]")
            lines += [f"{json.dumps(key, ensure_ascii=False)} = {toml_value(v)}" for key, v in body.items()]
    return "\n".join(lines) + "\n"


def assert_one_line(message: str, *names: str) -> None:
    assert message and "\n" not in message.strip(), message
    assert any(name in message for name in names), (message, names)


@FUZZ
@given(doc=documents())
def test_config_toml_fuzz(doc: dict[str, object], tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(render(doc))
    try:
        cfg = load_config(path)
    except ConfigError as e:  # the field's section is always named (sections are bare names here)
        assert_one_line(str(e), "c.toml", *doc)
        return
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg  # what a run directory stores reads back as the same config


FIELDS = [(section, name) for section, fields in SECTIONS.items() for name in fields]


def assert_accepted_value_is_usable(value: object) -> None:
    """What validation lets through must be usable downstream: finite, and an int64 for an integer."""
    if isinstance(value, float):
        assert math.isfinite(value), value
    if isinstance(value, int):
        assert -(2**63) <= value < 2**63, value


@FUZZ
@given(field=st.sampled_from(FIELDS), value=VALUES | st.text())
def test_config_field_fuzz(field: tuple[str, str], value: object, tmp_path: Path) -> None:
    """One field at a time, so every field meets every kind of value: refused naming it, or accepted as a
    usable value that survives the trip through to_toml (the run directory's config.toml)."""
    section, name = field
    path = tmp_path / "c.toml"
    path.write_text(render({section: {name: value}}))
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert_one_line(str(e), f"{section}.{name}", "c.toml")
        return
    assert_accepted_value_is_usable(getattr(getattr(cfg, section), name))
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@FEW
@given(section=st.sampled_from(list(SECTIONS)), key=st.text(min_size=1, max_size=6))
def test_config_unknown_key_fuzz(section: str, key: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(render({section: {key: 1}}))
    try:
        load_config(path)
    except ConfigError as e:
        assert_one_line(str(e), f"{section}.", "c.toml")
        assert "unknown field; valid: " in str(e) or key in SECTIONS[section] or "invalid TOML" in str(e), str(e)


@FEW
@given(raw=st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_config_file_bytes_fuzz(raw: bytes, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError as e:
        assert_one_line(str(e), "c.toml", "config error: ")


def overrides_of(pairs: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return parse_overrides([f"--{key}={value}" for key, value in pairs])


# A dotless key is a bad override too, but one argparse could take for an abbreviation of --config or --help.
NOT_AN_OPTION = BARE.filter(lambda key: not ("config".startswith(key) or "help".startswith(key)))


@FUZZ
@given(
    overrides=st.lists(
        st.tuples(
            st.one_of(st.sampled_from([f"{s}.{f}" for s, fields in SECTIONS.items() for f in fields]), NOT_AN_OPTION),
            st.one_of(st.sampled_from(WORDS), st.text(max_size=8), SCALARS.map(toml_value)),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_config_show_override_fuzz(overrides: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    """`meshlm config show --section.field=VALUE ...`: the resolved TOML, or one line naming the field."""
    capsys.readouterr()
    code = main(["config", "show", *(f"--{key}={value}" for key, value in overrides)])
    out, err = capsys.readouterr()
    if code == 0:
        assert Config.model_validate(tomllib.loads(out)) == load_config(None, overrides_of(overrides))
        return
    assert code == 2
    assert err.startswith("meshlm: config error: ")
    assert_one_line(err, *(key.split(".")[0] for key, _ in overrides))


# ---- Hugging Face config.json -------------------------------------------------------------------------------

SMALL = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96, max_seq_len=32)
HF_FIELDS = [*hf_config_from_model(SMALL), "rope_scaling", "partial_rotary_factor", "extra_field"]
DELETE = object()
ROPE = st.dictionaries(st.sampled_from(["rope_type", "type", "rope_theta", "partial_rotary_factor"]), SCALARS)
HF_VALUES = st.one_of(st.just(DELETE), st.none(), VALUES, ROPE)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(HF_FIELDS), HF_VALUES, min_size=1, max_size=3))
def test_hf_config_fuzz(changes: dict[str, object]) -> None:
    hf_config = hf_config_from_model(SMALL) | changes
    hf_config = {k: v for k, v in hf_config.items() if v is not DELETE}
    try:
        cfg = model_config_from_hf(hf_config)
    except ValueError as e:
        assert str(e).startswith("config.json: "), e
        assert_one_line(str(e), *changes)
        return
    assert isinstance(cfg, ModelConfig)


@pytest.fixture(scope="module")
def hf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("hf")
    export_hf(Transformer(SMALL), directory)
    return directory


def convert(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["convert", *args])
    return code, capsys.readouterr().err


@FEW
@given(changes=st.dictionaries(st.sampled_from(HF_FIELDS), HF_VALUES, min_size=1, max_size=2))
def test_convert_hf_config_fuzz(
    changes: dict[str, object], hf_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshlm convert hf-to-meshlm` on real weights with a mutated config.json: a field of another shape
    is caught against the stored tensors, naming the field or the tensor's file."""
    directory = tmp_path / "hf"
    shutil.copytree(hf_template, directory, dirs_exist_ok=True)
    hf_config = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps({k: v for k, v in hf_config.items() if v is not DELETE}))
    code, err = convert(["hf-to-meshlm", str(directory), str(tmp_path / "out.safetensors")], capsys)
    if code != 0:
        assert code == 2 and err.startswith("meshlm convert: error: "), err
        assert_one_line(err, *changes, "model.safetensors")


def corrupt(data: bytes, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    """`data` cut to `cut` bytes (None: whole), then byte i xor-ed with x for each (i, x) that lands in it."""
    out = bytearray(data[:cut])
    for i, x in flips:
        if i < len(out):
            out[i] ^= x
    return bytes(out)


# Most flips land in the header (the first few hundred bytes), where a corruption changes names and shapes.
CORRUPTIONS = st.tuples(
    st.one_of(st.none(), st.integers(0, 600), st.integers(0, 100_000)),
    st.lists(st.tuples(st.integers(0, 700), st.integers(1, 255)), max_size=2),
)


@FEW
@given(corruption=CORRUPTIONS)
def test_convert_corrupt_hf_safetensors_fuzz(
    corruption: tuple[int | None, list[tuple[int, int]]],
    hf_template: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = tmp_path / "hf"
    shutil.copytree(hf_template, directory, dirs_exist_ok=True)
    weights = directory / "model.safetensors"
    weights.write_bytes(corrupt((hf_template / "model.safetensors").read_bytes(), *corruption))
    code, err = convert(["hf-to-meshlm", str(directory), str(tmp_path / "out.safetensors")], capsys)
    if code != 0:
        assert code == 2, err
        assert_one_line(err, "model.safetensors")


@pytest.fixture(scope="module")
def meshlm_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("meshlm") / "ckpt.safetensors"
    _save_meshlm_file(Transformer(SMALL.replace(tie_embeddings=True)), path)
    return path


@FEW
@given(corruption=CORRUPTIONS)
def test_convert_corrupt_meshlm_safetensors_fuzz(
    corruption: tuple[int | None, list[tuple[int, int]]],
    meshlm_template: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(corrupt(meshlm_template.read_bytes(), *corruption))
    code, err = convert(["meshlm-to-hf", str(path), str(tmp_path / "hf_out")], capsys)
    if code != 0:
        assert code == 2, err
        assert_one_line(err, "ckpt.safetensors")


def test_fuzz_strategies_reach_both_outcomes(tmp_path: Path) -> None:
    """The generators above are only worth something if they produce valid input as well as invalid."""
    valid = {"train": {"steps": 7, "dtype": "fp32"}, "model": {"preset": "test"}, "data": {"seq_len": 64}}
    (tmp_path / "ok.toml").write_text(render(valid))
    assert load_config(tmp_path / "ok.toml").train.steps == 7
    (tmp_path / "bad.toml").write_text(render({"train": {"steps": math.nan}}))
    with pytest.raises(ConfigError, match=re.escape("train.steps: Input should be a finite number")):
        load_config(tmp_path / "bad.toml")


# ---- bad input to every subcommand: one line on stderr, naming the flag or field, and a failing exit code ----

BAD_INPUTS: list[tuple[list[str], str]] = [
    # train: config fields and overrides (checked before torch loads)
    (["train", "--train.steps", "-1"], "train.steps"),
    (["train", "--train.steps", "ten"], "train.steps"),
    (["train", "--train.lr", "nan"], "train.lr"),
    (["train", "--train.lr", "inf"], "train.lr"),
    (["train", "--train.global_batch", "0"], "train.global_batch"),
    (["train", "--train.global_batch", "6", "--train.micro_batch", "4"], "train.micro_batch"),
    (["train", "--train.dtype", "fp64"], "train.dtype"),
    (["train", "--train.device", "tpu"], "train.device"),
    (["train", "--train.recompute", "all"], "train.recompute"),
    (["train", "--train.recompute", "full", "--train.recompute_layers", "2"], "train.recompute_layers"),
    (["train", "--train.compile", "maybe"], "train.compile"),
    (["train", "--train.sync_every", "-2"], "train.sync_every"),
    (["train", "--train.stepz", "3"], "train.stepz"),
    (["train", "--trian.steps", "3"], "trian"),
    (["train", "--train", "3"], "train"),
    (["train", "--train.steps"], "train.steps"),
    (["train", "steps=3"], "steps=3"),
    (["train", "--train.seed", str(2**64)], "train.seed"),
    (["train", "--model.preset", "gpt5"], "model.preset"),
    (["train", "--model.dim", "0"], "model.dim"),
    (["train", "--model.n_heads", "-4"], "model.n_heads"),
    (["train", "--model.rope_type", "yarn"], "model.rope_type"),
    (["train", "--model.norm_eps", "0"], "model.norm_eps"),
    (["train", "--model.max_seq_len", "16", "--data.seq_len", "64"], "data.seq_len"),
    (["train", "--data.seq_len", "0"], "data.seq_len"),
    (["train", "--data.format", "csv"], "data.format"),
    (["train", "--data.format", "sft"], "data.source"),
    (["train", "--data.val_fraction", "2"], "data.val_fraction"),
    (["train", "--data.max_chars", "-5"], "data.max_chars"),
    (["train", "--parallel.zero", "4"], "parallel.zero"),
    (["train", "--parallel.schedule", "zigzag"], "parallel.schedule"),
    (["train", "--parallel.zero_shard_size", "2"], "parallel.zero_shard_size"),
    (["train", "--parallel.timeout_s", "-1"], "parallel.timeout_s"),
    (["train", "--lora.rank", "-1"], "lora.rank"),
    (["train", "--lora.init_from", "x"], "lora.init_from"),
    (["train", "--lora.dropout", "1.5"], "lora.dropout"),
    (["train", "--checkpoint.keep", "0"], "checkpoint.keep"),
    (["train", "--checkpoint.every", "-1"], "checkpoint.every"),
    (["train", "--checkpoint.resume", "perhaps"], "checkpoint.resume"),
    (["train", "--fault.nonfinite", "ignore"], "fault.nonfinite"),
    (["train", "--fault.max_skips", "0"], "fault.max_skips"),
    (["train", "--fault.max_rollbacks", "-1"], "fault.max_rollbacks"),
    (["train", "--fault.watchdog_s", "1e12"], "fault.watchdog_s"),
    (["train", "--fault.grace_s", "0"], "fault.grace_s"),
    (["train", "--log.every", "0"], "log.every"),
    (["train", "--log.tensorboard", "maybe"], "log.tensorboard"),
    (["train", "--log.nothing", "1"], "log.nothing"),
    (["train", "--config", "/nonexistent/run.toml"], "/nonexistent/run.toml"),
    # config show / reference
    (["config", "show", "--train.steps", "-3"], "train.steps"),
    (["config", "show", "--config", "/nonexistent.toml"], "/nonexistent.toml"),
    (["config", "show", "--model.vocab_size", "0"], "model.vocab_size"),
    (["config", "show", "--bogus"], "bogus"),
    (["config", "reference", "--train.steps", "3"], "--train.steps"),
    (["config"], "config_command"),
    (["config", "print"], "print"),
    # prepare-data
    (["prepare-data", "--workers", "0"], "--workers"),
    (["prepare-data", "--workers", "many"], "--workers"),
    (["prepare-data", "--shard-tokens", "0"], "--shard-tokens"),
    (["prepare-data", "--data.seq_len", "-1"], "data.seq_len"),
    (["prepare-data", "--config", "/nonexistent.toml"], "/nonexistent.toml"),
    # eval / generate
    (["check", "--steps", "1"], "--steps"),
    (["check", "--world", "9"], "dp=9"),
    (["check", "--parallel.layout", "dp=2,tp=3"], "tp"),
    (["eval", "/nonexistent-run"], "/nonexistent-run"),
    (["eval", "/nonexistent-run", "--batches", "x"], "--batches"),
    (["eval"], "run_dir"),
    (["eval", "/nonexistent-run", "--train.steps", "3"], "--train.steps"),
    (["generate", "/nonexistent-run"], "/nonexistent-run"),
    (["generate", "/nonexistent-run", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "/nonexistent-run", "--temperature", "-0.5"], "--temperature"),
    (["generate", "/nonexistent-run", "--temperature", "inf"], "--temperature"),
    (["generate", "/nonexistent-run", "--top-k", "0"], "--top-k"),
    (["generate", "/nonexistent-run", "--seed", "-1"], "--seed"),
    (["generate", "/nonexistent-run", "--prompt", ""], "--prompt"),
    (["generate"], "run_dir"),
    # convert
    (["convert"], "convert_mode"),
    (["convert", "hf-to-gguf", "a", "b"], "hf-to-gguf"),
    (["convert", "hf-to-meshlm", "/nonexistent-hf", "/tmp/x.safetensors"], "/nonexistent-hf"),
    (["convert", "meshlm-to-hf", "/nonexistent-run", "/tmp/out"], "/nonexistent-run"),
    (["convert", "meshlm-to-hf", "a", "b", "--dtype", "int8"], "--dtype"),
    (["convert", "meshlm-to-hf", "a", "b", "--max-shard-bytes", "0"], "--max-shard-bytes"),
    (["convert", "meshlm-to-hf", "a", "b", "--lora", "split"], "--lora"),
    (["convert", "meshlm-to-hf", "a"], "OUT_HF_DIR"),
    # plan, report, doctor
    (["plan", "--gpus", "8"], "--model"),
    (["plan", "--model", "tiny"], "--gpus"),
    (["plan", "--model", "gpt5", "--gpus", "8"], "gpt5"),
    (["plan", "--model", "tiny", "--gpus", "8", "--zero", "5"], "--zero"),
    (["plan", "--model", "tiny", "--gpus", "8", "--schedule", "zigzag"], "--schedule"),
    (["plan", "--model", "tiny", "--gpus", "8", "--precision", "fp8"], "--precision"),
    (["plan", "--model", "tiny", "--gpus", "8", "--objective", "speed"], "--objective"),
    (["plan", "--model", "tiny", "--gpus", "8", "--emit", "docker"], "--emit"),
    (["report"], "run_dir"),
    (["report", "/nonexistent-run"], "/nonexistent-run"),
    (["doctor", "--device", "tpu"], "--device"),
    (["doctor", "--min-bytes", "lots"], "--min-bytes"),
    # lighthouse (torchft's, for fault-tolerant replica groups)
    (["lighthouse", "--port", "0x"], "--port"),
    (["lighthouse", "--min-replicas", "0"], "--min-replicas"),
    (["lighthouse", "--heartbeat-timeout-s", "-1"], "--heartbeat-timeout-s"),
    # the command itself
    ([], "command"),
    (["trian"], "trian"),
    (["--verbose"], "command"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INPUTS])
def test_bad_input_to_every_subcommand_is_one_line_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors (meshlm.cli.Parser makes them one line)
        code = e.code
    err = capsys.readouterr().err
    assert code not in (0, None), (argv, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert named in err, (named, err)


def test_the_bad_input_table_covers_every_subcommand() -> None:
    from meshlm.cli import build_parser

    commands = {action.dest: action for action in build_parser()._subparsers._group_actions}["command"].choices
    tried = {argv[0] for argv, _ in BAD_INPUTS if argv}
    assert set(commands) - {"launch"} <= tried and len(BAD_INPUTS) >= 80  # launch: torchrun's own arguments
