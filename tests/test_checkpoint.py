"""Checkpoint folders: atomic commit, retention, verification, and skipping corrupt ones by name."""

import re
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _save(run: Path, step: int, keep: int = 3) -> Path:
    state = {"w": torch.full((4, 4), float(step))}
    optim = {"state": {0: {"exp_avg": torch.ones(3) * step}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return save_checkpoint(run, step, state, {"step": step}, optim, keep=keep)


def test_round_trip_and_retention(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    model, trainer, optim = load_checkpoint(latest_valid_checkpoint(tmp_path))
    assert trainer == {"step": 4} and model["w"][0, 0] == 4.0
    assert torch.equal(optim["state"][0]["exp_avg"], torch.ones(3) * 4)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    partial = tmp_path / "checkpoints" / ".tmp-step_00000002"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert latest_valid_checkpoint(tmp_path).name == "step_00000001"


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "remove"])
def test_corrupt_checkpoint_is_named_and_skipped(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    target = newest / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-8])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "manifest":
        target = newest / "manifest.json"
        target.unlink()
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
        verify_checkpoint(newest)
    warnings: list[str] = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert len(warnings) == 1 and str(target) in warnings[0]


def test_optimizer_file_is_loaded_without_unpickling_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple:
            return (print, ("pwned",))

    path = save_checkpoint(tmp_path, 1, {"w": torch.zeros(1)}, {"step": 1}, {"state": {}, "evil": Evil()})
    with pytest.raises(Exception, match=r"Weights only load failed|Unsupported global"):
        load_checkpoint(path)
