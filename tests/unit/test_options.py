"""The parallel options are declared once (meshlm.parallel.options) and the model's fields once
(meshlm.model.config.ModelConfig): the run config, the library API, the layout checks and the planner derive
from those declarations, and these tests fail if one of them re-declares or drops a field."""

from __future__ import annotations

import dataclasses
import inspect
from typing import get_args, get_type_hints

import pytest
import torch

import meshlm
from meshlm.config import LoraSection, ModelSection, ParallelSection, TrainSection, reference_help
from meshlm.errors import InputError
from meshlm.model.config import ModelConfig
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.options import DERIVED, PARALLEL_SECTION, TRAIN_SECTION, LoRAOptions, Loss, ParallelOptions
from meshlm.plan.memory import Candidate

OPTIONS = set(ParallelOptions.model_fields)


def test_every_option_has_one_home_in_the_run_config() -> None:
    """Each engine option is set by one config field, or derived by the trainer from named ones: none is
    dropped, none is set twice."""
    homes = [*PARALLEL_SECTION, *TRAIN_SECTION, *DERIVED]
    assert sorted(homes) == sorted(OPTIONS)


def test_the_config_section_is_the_options_plus_layout_and_timeout() -> None:
    assert set(ParallelSection.model_fields) == set(PARALLEL_SECTION) | {"layout", "timeout_s"}
    for name in PARALLEL_SECTION:
        assert repr(ParallelSection.model_fields[name]) == repr(ParallelOptions.model_fields[name]), name
        assert f"--parallel.{name} (default " in reference_help()
    section = ParallelSection(zero=2, schedule="gpipe", layout="dp=2")
    assert section.options() == ParallelOptions(zero=2, schedule="gpipe")


def test_the_train_section_takes_the_engine_and_loss_options_from_their_declarations() -> None:
    """train.fp8 and train.compile_backend are ParallelOptions' fields; train.ignore_index and train.fused_loss
    the Loss's (meshlm train fuses by default: its loop never reads the logits). `compile` stays the trainer's
    own choice (auto: CUDA only), resolved into the option."""
    for name in TRAIN_SECTION:
        assert repr(TrainSection.model_fields[name]) == repr(ParallelOptions.model_fields[name]), name
        assert f"--train.{name} (default " in reference_help()
    loss_fields = {f.name: f for f in dataclasses.fields(Loss)}
    for config_name, name in (("ignore_index", "ignore_index"), ("fused_loss", "fused")):
        field = TrainSection.model_fields[config_name]
        assert field.description == loss_fields[name].metadata["description"], name
        assert field.annotation is get_type_hints(Loss)[name], name
    assert TrainSection.model_fields["ignore_index"].default == Loss().ignore_index
    assert TrainSection().fused_loss and not Loss().fused
    assert TrainSection(fp8="emulate").fp8 == "emulate"  # the library's value is the config's too


def test_the_trainer_sets_every_option_from_the_config() -> None:
    """meshlm.train.startup.engine_options: the [parallel] and [train] fields and the derived ones, none left
    at a default the config cannot reach."""
    from meshlm.config import load_config, parse_overrides
    from meshlm.train.startup import engine_options

    args = ["--parallel.zero", "2", "--train.fp8", "emulate", "--train.compile_backend", "aot_eager",
            "--train.dtype", "bf16", "--parallel.schedule", "gpipe"]  # fmt: skip
    options = engine_options(load_config(None, parse_overrides(args)), torch.device("cpu"), 4, True)
    assert options == ParallelOptions(
        zero=2, schedule="gpipe", micro_batches=4, autocast_dtype="bf16", fp8="emulate", compile=True,
        compile_backend="aot_eager",
    )  # fmt: skip


def test_parallelize_takes_the_options_whole() -> None:
    """No engine option is a keyword argument of its own (they drifted: zero_reduce_dtype was missing; the
    micro-batches, autocast dtype, fp8 and compile backend were keywords beside the options); the keywords
    are the model's plan and loss and the transform before them all (lora, whole, and freeze: the [lora]
    section and train.freeze; lora_seed: train.seed)."""
    params = inspect.signature(meshlm.parallelize).parameters
    assert set(params) == {"model", "mesh", "options", "plan", "loss", "lora", "freeze", "lora_seed"}
    assert not set(LoRAOptions.model_fields) & set(params)
    assert "LoRAOptions" in str(params["lora"].annotation)
    assert not OPTIONS & set(params)
    assert "ParallelOptions" in str(params["options"].annotation)


def test_the_lora_section_is_the_lora_options() -> None:
    assert set(LoraSection.__annotations__) <= {"model_config"}  # declares no field of its own
    assert set(LoraSection.model_fields) == set(LoRAOptions.model_fields)
    for name, declared in LoRAOptions.model_fields.items():
        assert repr(LoraSection.model_fields[name]) == repr(declared), name
        assert f"--lora.{name} (default " in reference_help()
    with pytest.raises(InputError) as e:
        LoRAOptions(rank=-1)
    assert str(e.value).startswith("lora.rank: ") and "\n" not in str(e.value)


def test_the_layout_spec_and_the_planner_carry_the_options() -> None:
    """The planner's candidate holds a ParallelOptions (it re-declared five of them: issue #50); its other
    fields are the run config's [train] choices, none an option."""
    spec_fields = {f.name: f for f in dataclasses.fields(LayoutSpec)}
    assert not OPTIONS & set(spec_fields)
    assert get_type_hints(LayoutSpec)["options"] is ParallelOptions
    hints = get_type_hints(Candidate)
    assert hints["options"] is ParallelOptions
    assert not OPTIONS & set(hints)
    chosen = ParallelOptions(zero=2, schedule="zb1", sequence_parallel=True, cp_attention="ulysses")
    candidate = Candidate(options=chosen)
    assert (candidate.zero, candidate.schedule, candidate.cp_attention) == (2, "zb1", "ulysses")
    assert candidate.with_options(cp_attention="ring").options == chosen.model_copy(update={"cp_attention": "ring"})
    with pytest.raises(InputError, match=r"^parallel\.zero"):
        candidate.with_options(zero=4)


def test_options_refuse_bad_values_in_one_line() -> None:
    for bad, field in [({"zero": 4}, "parallel.zero"), ({"zeros": 1}, "parallel.zeros"), ({"schedule": "x"}, "")]:
        with pytest.raises(InputError) as e:
            ParallelOptions.of(bad)
        assert str(e.value).startswith(field or "parallel.schedule: Input should be 'gpipe'")
        assert "\n" not in str(e.value)
    assert ParallelOptions.of(None) == ParallelOptions()
    with pytest.raises(InputError, match="expected ParallelOptions or a dict"):
        ParallelOptions.of(["zero"])


def test_the_model_section_is_generated_from_model_config() -> None:
    fields = dataclasses.fields(ModelConfig)
    assert list(ModelSection.model_fields) == ["preset", "init_from", *(f.name for f in fields)]
    for f in fields:
        section = ModelSection.model_fields[f.name]
        assert section.default is None and section.description == f.metadata.get("description"), f.name
    assert ModelSection.model_fields["n_heads"].metadata[0].gt == 0  # the bound declared in ModelConfig
    assert get_args(get_args(ModelSection.model_fields["hf_model_type"].annotation)[0]) == get_args(
        get_type_hints(ModelConfig)["hf_model_type"]
    )
