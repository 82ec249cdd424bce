"""Checkpoint folders in a run directory: atomic, checksummed, found again after any crash.

Layout: `run_dir/checkpoints/step_00000100/` holding DCP's files (`.metadata` and one `__<rank>_0.distcp` per
writing rank), `trainer.json` (step, sampler, optimizer step count, model config, layout) and `manifest.json`
(size and sha256 of every other file). Every rank writes into `.tmp-step_00000100/`; rank 0 writes the
manifest last and renames the folder, so a checkpoint is visible only when complete and an interrupted save
leaves the previous one valid. The folder must be on storage every rank can reach (one node, or a shared
file system across nodes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.shards import ChunkLoadPlanner, SafeReader

MANIFEST = "manifest.json"
TRAINER = "trainer.json"


class CheckpointError(ValueError):
    """A missing, partial, corrupt or incompatible checkpoint, named by file."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_folder(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f".tmp-step_{step:08d}"


def commit_checkpoint(
    run_dir: Path, step: int, files: dict[str, dict[str, Any]], trainer_state: dict[str, Any], keep: int
) -> Path:
    """Rank 0, once every rank's files are in the staging folder: write trainer.json and the manifest
    (`files` are the ranks' own records), rename the folder into place, keep the newest `keep`."""
    tmp, final = staging_folder(run_dir, step), checkpoint_dir(run_dir) / f"step_{step:08d}"
    (tmp / TRAINER).write_text(json.dumps(trainer_state, indent=2))
    files = dict(files)
    for name in (".metadata", TRAINER):
        files[name] = file_record(tmp / name)
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=2))
    with manifest.open("rb") as f:
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (staging folders of interrupted saves are ignored)."""
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
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {manifest_path}: unreadable manifest ({e})") from None
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} has {file.stat().st_size} bytes, manifest says {meta['bytes']}"
            )
        if sha256_file(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {file} fails its sha256 check (corrupt)")


def latest_valid_checkpoint(run_dir: Path, warn: Callable[[str], Any] = print) -> Path | None:
    """The newest checkpoint that verifies; corrupt or partial ones are reported by name and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warn(f"skipping {e}")
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    file = path / TRAINER
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({e})") from None


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights (HF names) of a verified checkpoint, in this process alone (no process group):
    for generation, evaluation and export."""
    verify_checkpoint(path)
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model/") and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that it runs in one process: here that is the point
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), no_dist=True)
    return {key.removeprefix("model/"): t for key, t in state.items()}
