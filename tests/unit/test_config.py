"""Config: TOML + overrides, strict validation with one-line messages naming the field."""

from pathlib import Path

import pytest

from meshlm.config import (
    Config,
    ConfigError,
    load_config,
    model_config_from_dict,
    parse_overrides,
    reference_markdown,
    to_toml,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = load_config()
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_string_lists_round_trip_through_toml_on_every_save(tmp_path: Path) -> None:
    """train.freeze and lora.targets patterns keep their backslashes (regexes) however often a run saves them."""
    patterns = ["layers\\.0\\.", 'a"b', "tab\tc"]
    cfg = load_config(None, [("train.freeze", patterns), ("lora.rank", 4), ("lora.targets", ["q\\_proj"])])
    path = tmp_path / "c.toml"
    for _ in range(3):  # each resume writes the config it read
        path.write_text(to_toml(cfg))
        cfg = load_config(path)
    assert cfg.train.freeze == patterns and cfg.lora.targets == ["q\\_proj"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_overrides_parse_types_and_apply_over_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 10\nlr = 0.1\n")
    cfg = load_config(
        path, parse_overrides(["--train.steps", "50", "--parallel.layout=dp=2", "--log.tensorboard", "false"])
    )
    assert cfg.train.steps == 50 and cfg.train.lr == 0.1
    assert cfg.parallel.layout == "dp=2" and cfg.log.tensorboard is False


def test_model_overrides_build_a_model_config() -> None:
    cfg = load_config(
        None, parse_overrides(["--model.preset", "test", "--model.n_layers", "2", "--data.seq_len", "64"])
    )
    model = cfg.model.build()
    assert model.n_layers == 2 and model.dim == 64


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--train.steps", "0"], "train.steps: Input should be greater than 0"),
        (["--train.stepz", "3"], "train.stepz: unknown field"),
        (["--trian.steps", "3"], "trian: unknown section"),
        (["--parallel.zero_param_dtype", "bf16"], "parallel.zero_shard_size and parallel.zero_param_dtype need"),
        (["--train.lr", "fast"], "train.lr: Input should be a valid number"),
        (["--model.preset", "huge"], "model.preset: unknown preset 'huge'"),
        (["--model.n_heads", "5"], "model.dim (256) must be divisible by model.n_heads (5)"),
        (["--data.seq_len", "4096"], "data.seq_len (4096) exceeds model.max_seq_len (256)"),
        (["--train.global_batch", "10", "--train.micro_batch", "4"], "train.global_batch (10) must be divisible"),
        (["--parallel.zero", "4"], "parallel.zero: Input should be less than or equal to 3"),
        (["--parallel.schedule", "zigzag"], "parallel.schedule"),
        (["--fault.watchdog_s", "1e300"], "fault.watchdog_s: Input should be less than or equal to 604800"),
        (["--fault.grace_s", "inf"], "fault.grace_s: Input should be a finite number"),
        (["--train.steps"], "train.steps: missing value"),
        (["train.steps", "3"], "unexpected argument 'train.steps'"),
    ],
)
def test_bad_values_give_one_line_naming_the_field(args: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides(args))
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nbatch = 4\n")
    with pytest.raises(ConfigError, match=r"train\.batch: unknown field"):
        load_config(unknown)


def test_readme_config_reference_is_current() -> None:
    """The README's table is generated from the config classes; regenerate it with `meshlm config reference`."""
    assert reference_markdown() in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[train]\nlr = inf\n", "train.lr: Input should be a finite number"),
        ("[train]\nlr = nan\n", "train.lr: Input should be a finite number"),
        ("[train]\nsteps = 99999999999999999999999\n", "train.steps: Input should fit in 64 bits"),
        ("[parallel]\ntimeout_s = 1e300\n", "parallel.timeout_s: Input should be less than or equal to 604800"),
        ('[log]\nprofile_steps = "7:5"\n', "log.profile_steps: '7:5' needs 1 <= FIRST <= LAST"),
        ("model = 3\n", "model: should be a table of fields ([model]), got int"),
        ('[train]\n"a\\nb" = 1\n', 'train."a\\u000ab": unknown field; valid: steps, global_batch'),
        ("[trian]\nsteps = 1\n", "trian: unknown section; valid: model, data, train"),
        ("[model]\nn_heads = 256\nn_kv_heads = 1\n", "model.dim / model.n_heads = 1 must be even"),
    ],
)
def test_bad_toml_values_give_one_line_naming_the_field(toml: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_unreadable_files_and_overrides_into_a_non_table(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[train]")
    with pytest.raises(ConfigError, match=r"binary\.toml: not UTF-8 text \(byte 0\)"):
        load_config(binary)
    scalar = tmp_path / "scalar.toml"
    scalar.write_text("train = 3\n")
    with pytest.raises(ConfigError, match=r"train: should be a table of fields \(\[train\]\), got int"):
        load_config(scalar, parse_overrides(["--train.steps", "4"]))


def test_strings_round_trip_through_toml(tmp_path: Path) -> None:
    """Any string a field holds, control characters included, is written so that it reads back the same."""
    cfg = load_config(None, [("data.source", 'a"b\\c\nd\te\x00f\x7fg é')])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_model_config_from_dict_names_the_field() -> None:
    fields = load_config().model.build().to_dict()
    assert model_config_from_dict(fields, "ckpt") == load_config().model.build()
    with pytest.raises(ConfigError, match=r"^ckpt: model\.dim: Input should be a valid integer"):
        model_config_from_dict(fields | {"dim": "wide"}, "ckpt")
    with pytest.raises(ConfigError, match=r"^ckpt: model\.n_layers: missing$"):
        model_config_from_dict({k: v for k, v in fields.items() if k != "n_layers"}, "ckpt")
    with pytest.raises(ConfigError, match=r"^ckpt: model\.dim \(256\) must be divisible by model\.n_heads \(3\)"):
        model_config_from_dict(fields | {"n_heads": 3}, "ckpt")
    with pytest.raises(ConfigError, match=r"^ckpt: the model config should be an object of fields, got list"):
        model_config_from_dict([1], "ckpt")
