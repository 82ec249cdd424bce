"""Checkpoint folders in a run directory: atomic, checksummed, and loaded without executing code.

Layout: `run_dir/checkpoints/step_000100/` holding `model.safetensors` (full weights, HF names),
`optimizer.pt` (tensors only, read with `weights_only=True`), `trainer.json` (step, sampler, config) and
`manifest.json` (size and sha256 of every file). A folder is written under a temporary name and renamed
only when complete, so an interrupted save leaves the previous checkpoint valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A missing, partial or corrupt checkpoint, named by file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write step `step` atomically; keep the newest `keep` checkpoints. Returns the final folder."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (temporary folders of interrupted saves are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or altered."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint file {manifest_path} is missing (partial save?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {manifest_path}: unreadable manifest ({e})") from None
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} has {file.stat().st_size} bytes, manifest says {meta['bytes']}"
            )
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {file} fails its sha256 check (corrupt)")


def latest_valid_checkpoint(run_dir: Path, warn: Any = print) -> Path | None:
    """The newest checkpoint that verifies; corrupt or partial ones are reported by name and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warn(f"skipping {e}")
    return None


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    return load_file(str(file))


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """(model state, trainer state, optimizer state or None) of a verified checkpoint folder."""
    verify_checkpoint(path)
    model_state = load_model_state(path)
    trainer_state = json.loads((path / "trainer.json").read_text())
    optimizer_file = path / "optimizer.pt"
    optimizer_state = torch.load(optimizer_file, weights_only=True) if optimizer_file.is_file() else None
    return model_state, trainer_state, optimizer_state
