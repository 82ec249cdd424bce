"""Validated run configuration: TOML files plus `--section.field value` command-line overrides.

Every section is a strict pydantic model: unknown keys, wrong types and impossible values are rejected
with a one-line message that names the field (`ConfigError`), before any work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from meshlm.errors import ConfigError
from meshlm.model.config import FAMILY_FIELDS, PRESETS, ModelConfig
from meshlm.parallel.options import (
    PARALLEL_SECTION,
    TRAIN_SECTION,
    LoRAOptions,
    ParallelOptions,
    loss_field,
    option_fields,
    refuse_bool,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


INT64 = 2**63


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: object, info: ValidationInfo) -> object:
        return refuse_bool(cls, value, info)

    @field_validator("*")
    @classmethod
    def _fits_int64(cls, value: object) -> object:
        """Integers go to torch and numpy as int64: a larger one would overflow far from the config."""
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
            raise ValueError("Input should fit in 64 bits (between -2**63 and 2**63 - 1)")
        return value


class _PresetSection(Section):
    """A preset, optionally with any shape field overridden (e.g. `--model.n_layers 2`). ModelSection adds
    one optional field per ModelConfig field, generated from its declaration (below)."""

    preset: str = Field("tiny", description="named model shape: " + ", ".join(PRESETS))
    init_from: str | None = Field(
        None,
        description="fine-tune from: a Hugging Face checkpoint directory (config.json + safetensors) or a meshlm "
        "run / checkpoint; it defines the model (preset ignored; other model fields must agree) and the tokenizer",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
        return name

    _init_from_model: tuple[str, ModelConfig] | None = PrivateAttr(None)  # init_from and the model it defines

    def build(self) -> ModelConfig:
        """The model: the preset with the fields set here, or the model `init_from` defines (read once per
        section and kept: every step of a start asks for it), which the fields set here must equal."""
        overrides = {k: v for k, v in self.model_dump().items() if k not in ("preset", "init_from") and v is not None}
        if self.init_from is None:
            return PRESETS[self.preset].replace(**overrides)
        if self._init_from_model is None or self._init_from_model[0] != self.init_from:
            try:
                self._init_from_model = (self.init_from, init_from_config(self.init_from))
            except ValueError as e:
                raise ValueError(f"model.init_from: {e}") from None
        cfg = self._init_from_model[1]
        for name, value in overrides.items():
            if getattr(cfg, name) != value:
                raise ValueError(
                    f"model.{name}: {value!r} conflicts with the model of model.init_from {self.init_from} "
                    f"({getattr(cfg, name)!r}); leave it unset or equal"
                )
        return cfg


def _override(f: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """The `[model]` field overriding ModelConfig's field `f`: optional (None keeps the preset's), with the
    description and bounds that `f` declares (meshlm.model.config.option)."""
    meta = dict(f.metadata)
    return annotation | None, Field(None, description=meta.pop("description", None), **meta)


_SHAPE_TYPES = get_type_hints(ModelConfig)
ModelSection = create_model(
    "ModelSection",
    __base__=_PresetSection,
    __doc__="A preset, optionally with any shape field overridden (e.g. `--model.n_layers 2`).",
    **{f.name: _override(f, _SHAPE_TYPES[f.name]) for f in dataclasses.fields(ModelConfig)},
)


class DataSection(Section):
    """Where text comes from and how it is cut into training sequences."""

    source: str = Field("stdlib", description="'stdlib', a path to .txt/.jsonl files or a folder, or 'hf:NAME'")
    text_field: str = Field("text", description="field holding the text in .jsonl files and HF datasets")
    hf_split: str = Field("train", description="split of a Hugging Face dataset")
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="fraction of documents held out for validation")
    seq_len: int = Field(256, gt=1, description="tokens per training sequence")
    cache_dir: str = Field(".cache/meshlm", description="tokenizer and token files, reused across runs")
    max_chars: int | None = Field(None, gt=0, description="cap on corpus characters (tests, quick runs)")
    format: Literal["text", "sft"] = Field(
        "text",
        description="text: documents cut into windows; sft: .jsonl prompt/response pairs or chat messages, "
        "prompt tokens masked (docs/finetune.md)",
    )
    prompt_field: str = Field("prompt", description="sft: field holding the prompt of a prompt/response pair")
    response_field: str = Field("response", description="sft: field holding the response of a prompt/response pair")
    messages_field: str = Field("messages", description="sft: field holding a chat's list of {role, content}")
    sft_packing: bool = Field(
        True, description="sft: pack whole examples into each row (never split); false = one example per row"
    )


class _TrainFields(Section):
    """The [train] fields that are the trainer's own; TrainSection adds the engine's (declared in
    meshlm.parallel.options) where they belong in the section."""

    steps: int = Field(200, gt=0, description="optimizer steps")
    global_batch: int = Field(16, gt=0, description="sequences per optimizer step, over all replicas")
    micro_batch: int = Field(0, ge=0, description="sequences per forward/backward per replica; 0 = no accumulation")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr (cosine)")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay of matrices (norm weights never decay)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW β1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW β2")
    eps: float = Field(1e-8, gt=0, description="AdamW ε")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 disables clipping")
    seed: int = Field(1234, description="seeds the initial weights and the batch order")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 autocast on GPU, fp32 on CPU")
    recompute: Literal["none", "selective", "mlp", "full"] = Field(
        "none",
        description="activations recomputed in backward: selective = the attention core, mlp = each block's "
        "RMSNorm + SwiGLU half from its mid-point, full = each block",
    )
    recompute_layers: int = Field(
        0,
        ge=0,
        description="the first N blocks of each pipeline chunk are fully recomputed and the rest follow "
        "`recompute` (Megatron's --recompute-num-layers); 0: every block follows `recompute`",
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each transformer block (after parallelization); auto: on CUDA only"
    )
    sync_every: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="read loss and gradient norm on the host and check for SIGTERM every N steps (and on log, "
        "eval and checkpoint steps); 1 = every step; auto: 1 on CPU, only at those steps on CUDA (a bad "
        "update is then vetoed on the device, see docs/fault-tolerance.md)",
    )
    eval_every: int = Field(50, ge=0, description="validation loss every N steps; 0 = never")
    eval_batches: int = Field(8, gt=0, description="validation batches per evaluation")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: this rank's GPU if CUDA works, else CPU")
    freeze: list[str] = Field(
        [],
        description="parameter-name patterns kept frozen: no gradient, no optimizer state, not checkpointed",
    )


def _with_engine_fields(own: type[BaseModel], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`own`'s fields in order, with the engine's fields of `after[name]` placed after its field `name`."""
    fields: dict[str, Any] = {}
    for name, info in own.model_fields.items():
        fields[name] = (info.annotation, copy.copy(info))
        fields.update(after.get(name, {}))
    return fields


TrainSection = create_model(
    "TrainSection",
    __base__=Section,
    __doc__="The step loop: the batch, the optimizer, the dtype, and the engine's step options (the loss's "
    "ignore_index and fusing, FP8, the compile backend: meshlm.parallel.options declares them).",
    **_with_engine_fields(
        _TrainFields,
        {
            "recompute_layers": {
                "fused_loss": loss_field("fused", default=True),
                "ignore_index": loss_field("ignore_index"),
            },
            "compile": option_fields(TRAIN_SECTION),
        },
    ),
)


class LoraSection(LoRAOptions, Section):
    """LoRA's options (meshlm.parallel.options, declared there once)."""

    model_config = ConfigDict(frozen=False)
    # pydantic's own: errors are ValidationErrors that Config names by section (LoRAOptions' one-line
    # InputError is for the library, where the options are built alone; pydantic would nest it here).
    __init__ = BaseModel.__init__


class _ParallelSectionBase(Section):
    def options(self) -> ParallelOptions:
        """The engine's options this section sets (without the layout and the timeout; the rest at their
        defaults: the trainer sets the step's from [train], meshlm.train.startup.engine_options)."""
        return ParallelOptions(**self.model_dump(include=set(PARALLEL_SECTION)))


ParallelSection = create_model(
    "ParallelSection",
    __base__=_ParallelSectionBase,
    __doc__="The engine's [parallel] options (meshlm.parallel.options, declared there once), plus the layout, "
    "which builds the mesh, and the timeout, which sets up the process group.",
    **option_fields(PARALLEL_SECTION),
    layout=(
        str,
        Field(
            "",
            description=(
                "e.g. 'dp=4', 'pp=2,dp=2,tp=2' or 'dp=2,ep=2'; empty = all ranks data parallel; 'auto' = planner's pick"
            ),
        ),
    ),
    timeout_s=(float, Field(300.0, gt=0, le=7 * 24 * 3600, description="collective timeout before a rank gives up")),
)


class CheckpointSection(Section):
    every: int = Field(100, ge=0, description="save every N steps; 0 saves only at the end")
    keep: int = Field(3, gt=0, description="newest valid checkpoints kept (corrupt ones are moved aside, not counted)")
    resume: bool = Field(True, description="continue from the newest valid checkpoint")
    allow_fresh_start: bool = Field(
        False, description="when checkpoints exist but none is valid, train from step 0 instead of stopping"
    )
    async_save: bool = Field(True, description="write checkpoints in the background while training goes on")


WEEK_S = 7 * 24 * 3600.0  # longer timers are typos; past ~2**31 s they overflow the OS's timer calls


class FaultSection(Section):
    watchdog_s: float = Field(
        900.0,
        ge=0,
        le=WEEK_S,
        description="a rank that finishes no step for this long dumps stacks and exits 1; 0 = off",
    )
    nonfinite: Literal["skip", "rollback", "stop"] = Field(
        "skip",
        description="on a non-finite gradient norm or a loss spike: skip the update, roll back to the newest "
        "checkpoint (keeping the data position, so the batches since are skipped), or stop the run",
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks allowed in one run before it stops")
    max_skips: int = Field(
        5,
        gt=0,
        description="under 'skip': consecutive skipped updates before the run stops (keeping its newest checkpoint). "
        "A skip leaves the weights as they were, so vetoes on several different batches in a row mean the weights "
        "themselves have diverged, not one bad batch; 5 tolerates a short burst of bad data",
    )
    spike_factor: float = Field(0.0, ge=0, description="a loss above this × the recent mean counts as a spike; 0 = off")
    desync_every: int = Field(100, ge=0, description="compare data-parallel replicas' weights every N steps; 0 = off")
    grace_s: float = Field(
        120.0, gt=0, le=WEEK_S, description="after SIGTERM: finish the step and save within this, then exit 0"
    )
    replica_groups: int = Field(
        1,
        ge=1,
        description="fault-tolerant replica groups (torchft, extra meshlm[ft]): this many `meshlm launch`es of this "
        "config, each a group of its own (its index in env MESHLM_REPLICA_GROUP), joined by `meshlm lighthouse`; "
        "a group that dies is relaunched and heals from a live peer while the others keep stepping; 1 = off",
    )
    lighthouse: str = Field("", description="the lighthouse's HOST:PORT; '' = env TORCHFT_LIGHTHOUSE")
    collective_timeout_s: float = Field(
        30.0,
        gt=0,
        le=WEEK_S,
        description="replica groups: a collective across groups (and a heal's transfer) failing after this; it "
        "bounds a stalled or partitioned group's cost, so it must exceed a step's skew between groups plus a heal",
    )
    quorum_timeout_s: float = Field(
        60.0,
        gt=0,
        le=WEEK_S,
        description="replica groups: a group waiting this long for a quorum exits (to be relaunched); the longest "
        "partition ridden out without a restart; above collective_timeout_s",
    )

    @model_validator(mode="after")
    def _ladder(self) -> FaultSection:
        if self.replica_groups > 1 and self.quorum_timeout_s <= self.collective_timeout_s:
            raise ValueError(
                f"fault.quorum_timeout_s ({self.quorum_timeout_s}) must exceed fault.collective_timeout_s "
                f"({self.collective_timeout_s}): a quorum waits for the slowest group's collectives "
                "(docs/fault-tolerance.md)"
            )
        return self


class LogSection(Section):
    run_dir: str = Field("runs/default", description="checkpoints, metrics and the resolved config")
    every: int = Field(10, gt=0, description="log training metrics every N steps")
    tensorboard: bool = Field(True, description="also write TensorBoard event files")
    progress: bool = Field(True, description="show the progress bar")
    aggregate_every: int = Field(10, ge=0, description="min/median/max over ranks and straggler check every N steps")
    straggler_threshold: float = Field(1.2, gt=1, description="a rank whose compute time exceeds this × the median")
    peak_flops: float = Field(0.0, ge=0, description="device peak FLOP/s for MFU; 0 = from the GPU table or measured")
    activation_memory: bool = Field(False, description="measure saved-activation bytes each step")
    profile_steps: str = Field("", description="torch profiler trace of steps 'A:B' into run_dir/profile")
    wandb_project: str = Field(
        "", description="also log to this Weights & Biases project (extra meshlm[wandb]); '' = off"
    )
    mlflow_experiment: str = Field(
        "", description="also log to this MLflow experiment (extra meshlm[mlflow]); '' = off"
    )

    @field_validator("profile_steps")
    @classmethod
    def _steps_range(cls, text: str) -> str:
        parse_steps(text)
        return text


def parse_steps(text: str) -> tuple[int, int] | None:
    """'5:7' -> (5, 7) (inclusive), '5' -> (5, 5), '' -> None (no profiling)."""
    if not text.strip():
        return None
    first, _, last = text.partition(":")
    try:
        window = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"log.profile_steps: {text!r} is not FIRST:LAST (e.g. 5:7)") from None
    if not 1 <= window[0] <= window[1]:
        raise ValueError(f"log.profile_steps: {text!r} needs 1 <= FIRST <= LAST")
    return window


class Config(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    parallel: ParallelSection = ParallelSection()
    lora: LoraSection = LoraSection()
    checkpoint: CheckpointSection = CheckpointSection()
    fault: FaultSection = FaultSection()
    log: LogSection = LogSection()

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        try:
            model = self.model.build()
        except ValueError as e:
            raise ValueError(str(e)) from None
        if self.train.recompute == "full" and self.train.recompute_layers:
            raise ValueError(
                f"train.recompute_layers ({self.train.recompute_layers}) recomputes some blocks fully, but "
                "train.recompute = 'full' already recomputes all of them: use none, selective or mlp"
            )
        if self.data.seq_len > model.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({model.max_seq_len})")
        if model.sliding_window and self.data.seq_len > model.sliding_window:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.sliding_window ({model.sliding_window}): "
                "meshlm's full causal attention equals sliding-window attention only within the window"
            )
        if self.data.format == "sft" and (self.data.source == "stdlib" or self.data.source.startswith("hf:")):
            raise ValueError(
                f"data.source: data.format = 'sft' reads .jsonl files, not {self.data.source!r}; give a .jsonl "
                "file or a folder of them"
            )
        if self.data.format == "sft" and self.data.max_chars is not None:
            raise ValueError("data.max_chars caps a text corpus; with data.format = 'sft' leave it unset")
        if self.data.format == "sft" and self.train.ignore_index != -100:
            raise ValueError(
                f"train.ignore_index = {self.train.ignore_index}: data.format = 'sft' labels prompt and padding "
                "positions -100; leave train.ignore_index at -100"
            )
        if self.parallel.zero == 0 and (
            self.parallel.zero_shard_size or self.parallel.zero_param_dtype not in ("auto", "fp32")
        ):
            raise ValueError("parallel.zero_shard_size and parallel.zero_param_dtype need parallel.zero >= 1")
        if self.lora.init_from and not self.lora.rank:
            raise ValueError("lora.init_from needs lora.rank > 0 (the adapter's rank)")
        if self.train.micro_batch and self.train.global_batch % self.train.micro_batch:
            raise ValueError(
                f"train.global_batch ({self.train.global_batch}) must be divisible by "
                f"train.micro_batch ({self.train.micro_batch})"
            )
        return self


def _key(part: object) -> str:
    """A field name as TOML would write it: bare when it can be, else quoted (so it stays on one line)."""
    text = str(part)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else _toml_string(text)


def _valid_fields(loc: tuple) -> str:
    """The field names that would be valid where `loc` points (for 'unknown field' messages)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    return ", ".join(model.model_fields)


def _format_error(err: ValidationError, prefix: tuple[str, ...] = ()) -> str:
    """The first error as 'config error: section.field: what is wrong' (`prefix`: where `err`'s model sits)."""
    errors = err.errors()
    first = errors[0]
    loc = (*prefix, *first["loc"])
    msg = first["msg"]
    if len(loc) == 3 and loc[0] in Config.model_fields and isinstance(loc[2], str):  # a field of several types
        msg = " or ".join(e["msg"] for e in errors if (*prefix, *e["loc"])[:2] == loc[:2])
        loc = loc[:2]
    field = ".".join(_key(p) for p in loc)
    msg = msg.removeprefix("Value error, ").removeprefix(f"{field}: ")
    if first["type"] == "extra_forbidden":
        msg = f"unknown {'section' if len(loc) == 1 else 'field'}; valid: {_valid_fields(loc)}"
    elif first["type"] == "model_type":
        msg = f"should be a table of fields ([{field}]), got {type(first['input']).__name__}"
    return f"config error: {field}: {msg}" if field else f"config error: {msg}"


def _parse_value(text: str) -> Any:
    """Command-line values are parsed as TOML scalars when possible (`3`, `1e-3`, `true`), else strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"config error: {dotted}: overrides look like --section.field VALUE")
    section, field = parts
    if section not in Config.model_fields:
        raise ConfigError(f"config error: {_key(section)}: unknown section; valid: {', '.join(Config.model_fields)}")
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(
            f"config error: {section}: should be a table of fields ([{section}]), got {type(table).__name__}"
        )
    table[field] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn ['--train.steps', '50', '--log.run_dir=x'] into [('train.steps', 50), ('log.run_dir', 'x')]."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"config error: unexpected argument {arg!r}; overrides look like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"config error: {key}: missing value")
            text = args[i + 1]
            i += 2
        out.append((key, _parse_value(text)))
    return out


def load_config(path: str | Path | None = None, overrides: list[tuple[str, Any]] | None = None) -> Config:
    """Read a TOML file (or defaults), apply overrides, validate everything; raise ConfigError on any problem."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: file {path} not found")
        try:
            data = tomllib.loads(path.read_bytes().decode())
        except OSError as e:
            raise ConfigError(f"config error: {path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config error: {path}: not UTF-8 text (byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config error: {path}: invalid TOML ({e})") from None
    for key, value in overrides or []:
        _apply_override(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def _toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped, so it reads back the same."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m[0]):04x}", escaped) + '"'


def init_from_config(init_from: str) -> ModelConfig:
    """The model `init_from` defines: an HF directory's config.json, or the model config a meshlm checkpoint
    records. One-line ValueError naming the file otherwise; a path that is none of these is refused before
    the checkpoint modules (and torch) are imported, so a mistyped path is one line within a second."""
    check_init_from(init_from)
    from meshlm.checkpoint import meshlm_checkpoint, read_trainer_state
    from meshlm.model.hf import read_hf_config
    from meshlm.model.pretrained import is_hf_directory

    checkpoint = None if is_hf_directory(init_from) else meshlm_checkpoint(init_from)
    if checkpoint is not None:
        state = read_trainer_state(checkpoint)
        return model_config_from_dict(state.get("model") if isinstance(state, dict) else None, str(checkpoint))
    try:
        return read_hf_config(init_from)
    except OSError as e:
        raise ValueError(f"{e.filename or init_from}: {e.strerror or e}; valid: {INIT_FROM_VALID}") from None


INIT_FROM_VALID = (
    "a Hugging Face checkpoint directory with config.json and *.safetensors, a meshlm run directory "
    "or one of its checkpoints"
)


def check_init_from(init_from: str) -> None:
    """Refuse an init_from that is not a directory holding config.json (Hugging Face), trainer.json (a meshlm
    checkpoint) or checkpoints/ (a meshlm run): cheap, no torch; what the files hold is checked when read."""
    path = Path(init_from)
    if not path.exists():
        raise ValueError(f"{init_from} not found; valid: {INIT_FROM_VALID}")
    markers = ("config.json", "trainer.json", "checkpoints")
    if not path.is_dir() or not any((path / name).exists() for name in markers):
        raise ValueError(f"{init_from} is not a checkpoint (no {', '.join(markers)} in it); valid: {INIT_FROM_VALID}")
    run, saved = not (path / "config.json").exists() and not (path / "trainer.json").exists(), path / "checkpoints"
    if run and not (saved.is_dir() and any(p.is_dir() and p.name.startswith("step_") for p in saved.iterdir())):
        raise ValueError(f"{init_from} is a meshlm run with no committed checkpoint yet (checkpoints/ has no step_*)")


def model_config_from_dict(values: object, where: str) -> ModelConfig:
    """A ModelConfig from its `to_dict()` form (as a checkpoint stores it), validated like the [model] section;
    a ConfigError names `where` and the field."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: the model config should be an object of fields, got {type(values).__name__}")
    missing = [name for name in ModelConfig.__dataclass_fields__ if name not in values and name not in FAMILY_FIELDS]
    if missing:
        raise ConfigError(f"{where}: model.{missing[0]}: missing")
    try:
        return ModelSection.model_validate(values).build()
    except ValidationError as e:
        raise ConfigError(f"{where}: {_format_error(e, ('model',)).removeprefix('config error: ')}") from None
    except ValueError as e:  # a shape ModelConfig refuses (e.g. dim not divisible by n_heads)
        raise ConfigError(f"{where}: {e}") from None


def to_toml(cfg: Config) -> str:
    """Render the resolved config as TOML (None fields omitted), for `meshlm config show` and run dirs."""
    lines: list[str] = []
    for section, values in cfg.model_dump().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = _toml_string(value)
            elif isinstance(value, list):  # TOML's own quoting (a Python repr would double every backslash)
                text = "[" + ", ".join(_toml_string(v) if isinstance(v, str) else repr(v) for v in value) + "]"
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def reference_markdown() -> str:
    """A table of every field with its default and meaning (kept in the README; a test checks it is current)."""
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for section, section_field in Config.model_fields.items():
        model = section_field.annotation
        for name, f in model.model_fields.items():
            default = "" if f.default is None else f"`{f.default!r}`".replace("|", "\\|")
            meaning = (f.description or f"override the preset's `{name}`").replace("|", "\\|")
            lines.append(f"| `{section}.{name}` | {default} | {meaning} |")
    return "\n".join(lines)


def reference_help() -> str:
    """Every field as an override, with its default and meaning (the epilog of `meshlm train --help-all`)."""
    lines = ["config fields (--section.field VALUE; the defaults apply to everything not set):"]
    for section, section_field in Config.model_fields.items():
        lines.append(f"  [{section}]")
        for name, f in section_field.annotation.model_fields.items():
            default = "the preset's" if f.default is None and section == "model" else repr(f.default)
            meaning = f.description or f"override the preset's {name}"
            lines.append(f"    --{section}.{name} (default {default}): {meaning}")
    return "\n".join(lines)
