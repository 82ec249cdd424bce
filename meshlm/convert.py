"""A trained run's model out of its checkpoints, and `meshlm convert`.

`load_checkpoint_model` builds the model a checkpoint records (a LoRA or train.freeze run's base rebuilt from
its config.toml, the trained tensors loaded on it, adapters merged); `run_convert` moves weights between an
HF directory, a meshlm safetensors file and a run. This reads runs (config, checkpoints, adapters), so it
sits above them in meshlm's layers (tests/unit/test_layers.py), unlike the HF format itself (meshlm.model.hf).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch import nn

from meshlm.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    load_model_state,
    meshlm_checkpoint,
    read_trainer_state,
)
from meshlm.config import load_config, model_config_from_dict
from meshlm.data.generation import write_generation_ids
from meshlm.model import Transformer
from meshlm.model.hf import (
    MESHLM_CONFIG_KEY,
    _check_shapes,
    _error_line,
    _expected_shapes,
    _open_safetensors,
    load_hf_into_model,
    tied_names,
)
from meshlm.model.hf_export import _save_meshlm_file, export_hf
from meshlm.model.pretrained import check_run_tokenizer, copy_run_tokenizer, is_hf_directory
from meshlm.parallel.transforms.lora import (
    LoRAError,
    LoRASpec,
    apply_lora,
    export_peft,
    freeze_patterns_match,
    lora_spec,
    merge_lora,
)
from meshlm.ties import canonical_state, load_state, unique_state_names


def load_checkpoint_model(path: Path) -> tuple[Transformer, Path]:
    """The model of a training checkpoint folder, or of a run directory's newest valid checkpoint, built
    from the model config the checkpoint records. Checkpoints skipped as corrupt are printed to stderr,
    or named in the error when none is valid."""
    checkpoint: Path | None = path
    if not (path / "trainer.json").is_file():
        skipped: list[str] = []
        checkpoint = latest_valid_checkpoint(path, warn=skipped.append)
        if checkpoint is None:
            reasons = f" ({'; '.join(skipped)})" if skipped else ""
            raise CheckpointError(f"{path}: no valid checkpoint under {path / 'checkpoints'}{reasons}")
        for line in skipped:
            print(line, file=sys.stderr)
    trainer_state = read_trainer_state(checkpoint)
    model_fields = trainer_state.get("model") if isinstance(trainer_state, dict) else None
    model = Transformer(model_config_from_dict(model_fields, str(checkpoint / "trainer.json")))
    state = load_model_state(checkpoint)
    if any(".lora_A" in name for name in state) or not set(unique_state_names(model)) <= set(
        canonical_state(model, state, str(checkpoint))
    ):  # LoRA / train.freeze: the checkpoint holds the trained tensors only, rebuilt on their base
        return merge_lora(rebuild_run_model(checkpoint, state)[0]), checkpoint
    try:
        load_state(model, state, str(checkpoint))  # a tied weight is saved once
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return model, checkpoint


def _load_meshlm_file(path: Path) -> Transformer:
    """A meshlm safetensors file, a training checkpoint folder, or a run directory (its newest checkpoint)."""
    if path.is_dir():
        return load_checkpoint_model(path)[0]
    with _open_safetensors(path) as f:
        metadata = f.metadata() or {}
        names = f.keys()
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    if MESHLM_CONFIG_KEY not in metadata:
        raise ValueError(f"{path}: no {MESHLM_CONFIG_KEY} metadata; not a meshlm checkpoint file")
    try:
        fields = json.loads(metadata[MESHLM_CONFIG_KEY])
    except ValueError as e:
        raise ValueError(f"{path}: metadata {MESHLM_CONFIG_KEY} is not JSON ({_error_line(e)})") from None
    cfg = model_config_from_dict(fields, f"{path}: metadata {MESHLM_CONFIG_KEY}")
    aliases = tied_names(cfg)  # save_model stores a tied weight under one of its names
    shapes = {aliases.get(name, name): shape for name, shape in shapes.items()}
    _check_shapes(shapes, _expected_shapes(cfg), lambda _: str(path))
    model = Transformer(cfg)
    load_model(model, path, strict=True)
    return model


def _run_adapters(src: Path) -> tuple[dict[str, torch.Tensor], Any, str]:
    """(adapter tensors, LoRASpec, the base's init_from) of a LoRA run directory or checkpoint folder."""
    checkpoint = meshlm_checkpoint(src) if src.is_dir() else None
    if checkpoint is None:
        raise ValueError(f"{src}: --lora peft needs a meshlm LoRA run directory or checkpoint folder")
    model, spec = rebuild_run_model(checkpoint, load_model_state(checkpoint))
    if spec is None:
        raise LoRAError(f"{checkpoint}: not a LoRA run (its config.toml has lora.rank = 0)")
    base = load_config(checkpoint.parent.parent / "config.toml").model.init_from or ""
    return model.state_dict(), spec, base


def export_run(
    src: Path, out: Path, lora: str = "merged", dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None
) -> None:
    """`meshlm convert meshlm-to-hf SRC OUT`: a meshlm file, checkpoint folder or run directory as an HF directory
    (a LoRA run's adapters merged, with the run's tokenizer), or with `lora="peft"` a LoRA run's adapters as a
    PEFT adapter directory naming its base. Bad input is a one-line ValueError or OSError."""
    if lora == "peft":
        state, spec, base = _run_adapters(src)
        export_peft(state, spec, out, base)
        return
    if src.is_dir():
        check_run_tokenizer(src)  # before anything is written
    export_hf(_load_meshlm_file(src), out, dtype, max_shard_bytes)
    if src.is_dir():
        copy_run_tokenizer(src, out)
        write_generation_ids(out)


def run_convert(args: argparse.Namespace) -> int:
    """Run a parsed `meshlm convert` command. Bad input (a refused checkpoint or HF directory, a missing or
    unreadable source) gives a one-line error and exit code 2, as `meshlm eval` and `generate` do for the same
    checkpoint; a failure to write the output (a full disk, no permission) exit code 1."""
    try:
        if args.convert_mode == "hf-to-meshlm":
            _save_meshlm_file(load_hf_into_model(args.src), args.out)
        else:
            lora = getattr(args, "lora", "merged")
            export_run(args.src, args.out, lora, getattr(torch, args.dtype), args.max_shard_bytes)
    except (ValueError, OSError) as e:
        print(f"meshlm convert: error: {e}", file=sys.stderr)
        return 1 if _writing(e, Path(args.out)) else 2
    print(f"wrote {args.out}")
    return 0


def _writing(error: BaseException, out: Path) -> bool:
    """Whether `error` is a failure to write the output `out`: an OSError naming it, a path under it or a
    temporary sibling of it (an atomic write's `out.tmp-...`)."""
    name = getattr(error, "filename", None)
    if not isinstance(error, OSError) or name is None:
        return False
    path, out = Path(os.fsdecode(name)).absolute(), out.absolute()
    return out in (path, *path.parents) or (path.parent == out.parent and path.name.startswith(out.name))


def rebuild_run_model(checkpoint: Path, state: dict[str, torch.Tensor]) -> tuple[nn.Module, LoRASpec | None]:
    """The model of a checkpoint that holds only what trained (a LoRA or train.freeze run): the base rebuilt
    as the run built it (its model.init_from, else the seeded init of train.seed), the run's adapters
    applied, then the checkpoint's tensors loaded. The run's config.toml says how; one-line error without it."""
    config_file = checkpoint.parent.parent / "config.toml"
    if not config_file.is_file():
        raise LoRAError(
            f"{checkpoint} holds only the trained weights (LoRA or train.freeze); the run's config.toml, which "
            f"names its base, is missing ({config_file})"
        )
    cfg = load_config(config_file)
    init_from = cfg.model.init_from
    if init_from is None:
        model = Transformer(cfg.model.build(), init_seed=cfg.train.seed)
    elif is_hf_directory(init_from):
        model = load_hf_into_model(init_from)
    else:
        base = meshlm_checkpoint(init_from)
        if base is None:
            raise LoRAError(f"{config_file}: model.init_from {init_from} (the base of {checkpoint}) is gone")
        model = load_checkpoint_model(base)[0]
    spec = None
    if cfg.lora.rank:
        lora = cfg.lora
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets or None, seed=cfg.train.seed)
        spec = lora_spec(model)
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise LoRAError(f"{checkpoint}: {unknown[0]} is not a parameter of the model its config.toml builds")
    # Only a LoRA base or a train.freeze weight comes from the rebuilt base: a weight the run trained and the
    # checkpoint lacks would silently be the base's (the seeded initial weights): refused.
    frozen = set(freeze_patterns_match(model, cfg.train.freeze)) if cfg.train.freeze else set()
    missing = [n for n, p in params.items() if p.requires_grad and n not in frozen and n not in state]
    if missing:
        raise CheckpointError(
            f"{checkpoint}: model weight {missing[0]} is missing, but the run's config.toml trains it (it is no "
            "LoRA base or train.freeze weight); the checkpoint is incomplete: use another checkpoint of the run"
        )
    with torch.no_grad():
        for name, value in state.items():
            if tuple(value.shape) != tuple(params[name].shape):
                shape = tuple(params[name].shape)
                raise LoRAError(f"{checkpoint}: {name} has shape {tuple(value.shape)}, its model's is {shape}")
            params[name].copy_(value)
    return model, spec
