"""Checkpoint folders: box decomposition, atomic commit, retention, async staging, verification, skipping
corrupt ones by name, and loading without executing code from the checkpoint."""

import json
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from meshlm.checkpoint import (
    CheckpointError,
    CheckpointIO,
    latest_valid_checkpoint,
    list_checkpoints,
    load_model_state,
    verify_checkpoint,
)
from meshlm.checkpoint.shards import Chunks, SafeReader, flat_range_boxes
from meshlm.checkpoint.store import file_record


@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_flat_range_boxes_cover_exactly_the_range_in_order(shape: list[int], data: st.DataObject) -> None:
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    flat = torch.arange(n).view(shape)
    boxes = flat_range_boxes(shape, start, stop)
    covered = [flat[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1) for off, size in boxes]
    assert torch.equal(torch.cat(covered) if covered else torch.zeros(0, dtype=torch.long), torch.arange(start, stop))
    if len(shape) == 2:
        assert len(boxes) <= 3


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _entries(value: float) -> dict:
    """A 6×4 weight held as two row boxes, the way a ZeRO shard of it would be."""
    w = torch.full((6, 4), value)
    return {"model/w": Chunks(torch.Size([6, 4]), [(0, 0), (2, 0)], [w[:2], w[2:]])}


def _save(run: Path, step: int, keep: int = 3, async_save: bool = False) -> Path:
    ckpt = CheckpointIO(run, keep=keep, async_save=async_save, timeout_s=30)
    ckpt.save(step, _entries(float(step)), {"step": step})
    ckpt.wait()
    return run / "checkpoints" / f"step_{step:08d}"


def test_round_trip_and_retention(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2, async_save=step % 2 == 0)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    newest = latest_valid_checkpoint(tmp_path)
    assert torch.equal(load_model_state(newest)["w"], torch.full((6, 4), 4.0))
    assert json.loads((newest / "trainer.json").read_text()) == {"step": 4}
    target = _entries(0.0)
    CheckpointIO(tmp_path, keep=2, async_save=False, timeout_s=30).load(newest, target)
    assert all(torch.equal(v, torch.full_like(v, 4.0)) for v in target["model/w"].views)


def test_async_save_copies_state_into_one_reused_staging_buffer(tmp_path: Path) -> None:
    ckpt = CheckpointIO(tmp_path, keep=3, async_save=True, timeout_s=30)
    live = _entries(1.0)
    ckpt.save(1, live, {"step": 1})
    buffer = ckpt.staging.data_ptr()
    for view in live["model/w"].views:
        view.fill_(99.0)  # training goes on while the save is written: the checkpoint must not see this
    ckpt.wait()
    ckpt.save(2, live, {"step": 2})
    ckpt.wait()
    assert ckpt.staging.data_ptr() == buffer
    rng_bytes = torch.get_rng_state().numel()
    assert ckpt.staging_bytes == 2 * 64 + -(-rng_bytes // 64) * 64  # two 32-byte boxes and the RNG state, aligned
    assert torch.equal(load_model_state(tmp_path / "checkpoints" / "step_00000001")["w"], torch.ones(6, 4))
    assert torch.equal(load_model_state(tmp_path / "checkpoints" / "step_00000002")["w"], torch.full((6, 4), 99.0))


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    partial = tmp_path / "checkpoints" / ".tmp-step_00000002"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert latest_valid_checkpoint(tmp_path).name == "step_00000001"


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "metadata"])
def test_corrupt_checkpoint_is_named_and_skipped(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    target = newest / "__0_0.distcp"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-8])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        target = newest / ("manifest.json" if damage == "manifest" else ".metadata")
        target.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
        verify_checkpoint(newest)
    warnings: list[str] = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert len(warnings) == 1 and str(target) in warnings[0]


class Evil:
    def __reduce__(self) -> tuple:
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def test_metadata_is_read_without_unpickling_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with a forged manifest (checksums match), a .metadata carrying code is refused, not run."""
    monkeypatch.chdir(tmp_path)
    path = _save(tmp_path, 1)
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"] = file_record(path / ".metadata")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"cannot be loaded: UnpicklingError: builtins\.exec is not a DCP metad"):
        load_model_state(path)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pickled_entries_are_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.zeros(2), "extra": "any object"}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointError, match="extra is a pickled object; refused"):
        CheckpointIO(tmp_path, keep=3, async_save=False, timeout_s=30).load(tmp_path, {"extra": ""})


def test_missing_entry_is_a_clear_error(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    wanted = {**_entries(0.0), "model/other": Chunks(torch.Size([2]), [(0,)], [torch.zeros(2)])}
    with pytest.raises(CheckpointError, match=r"step_00000001 lacks entry model/other"):
        CheckpointIO(tmp_path, keep=3, async_save=False, timeout_s=30).load(path, wanted)


def test_metadata_is_read_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The missing-entry check and DCP's load share one read of `.metadata` (issue #13)."""
    path = _save(tmp_path, 1)
    reads: list[Path] = []
    read = SafeReader.read_metadata

    def counted(self: SafeReader, *args: object, **kwargs: object) -> object:
        reads.append(Path(self.path))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(SafeReader, "read_metadata", counted)
    target = _entries(0.0)
    CheckpointIO(tmp_path, keep=3, async_save=False, timeout_s=30).load(path, target)
    assert reads == [path] and torch.equal(target["model/w"].views[0], torch.ones(2, 4))
    load_model_state(path)
    assert reads == [path, path]
