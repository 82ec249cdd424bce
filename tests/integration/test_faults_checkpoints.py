"""Faults of issue #14, A–C, injected: a corrupt newest checkpoint meets retention (A), the disk fills up during
a save (B), and staging folders of failed saves are left behind (C). Each ends with nothing valid lost and one
line saying what happened."""

from __future__ import annotations

import errno
import io
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from torch.distributed.checkpoint.filesystem import FileSystem

from meshlm.checkpoint import CheckpointIO, StorageError, list_checkpoints, storage_cause
from meshlm.checkpoint.shards import Chunks
from meshlm.checkpoint.store import CheckpointFolders
from meshlm.cli import main
from meshlm.config import load_config, parse_overrides
from meshlm.observe.metrics import read_metrics
from meshlm.train.trainer import train


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _run(small_run: list[str], *extra: str) -> list[str]:
    return [*small_run, "--train.eval_every", "0", "--log.peak_flops", "1e12", *extra]


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


# ---- A: retention and corrupt checkpoints -------------------------------------------------------------------
def test_corrupt_newest_is_moved_aside_and_retention_keeps_the_valid_ones(
    small_run: list[str], capsys: pytest.CaptureFixture
) -> None:
    """The issue's reproduction, shortened: steps 2, 4, 6 saved; 6 corrupted; a run to step 5 with keep=1
    resumes from 4 and must not end with only the corrupt checkpoint left (it used to delete 4 and 5)."""
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    train(load_config(None, parse_overrides(_run(small_run, "--train.steps", "6", "--checkpoint.every", "2"))))
    _flip_byte(run_dir / "checkpoints" / "step_00000006" / "__0_0.distcp")
    capsys.readouterr()

    again = _run(small_run, "--train.steps", "5", "--checkpoint.every", "1", "--checkpoint.keep", "1")
    resumed = train(load_config(None, parse_overrides(again)))
    out = capsys.readouterr().out
    assert resumed.start_step == 4 and resumed.final_step == 5
    assert _names(run_dir) == ["corrupt-step_00000006", "step_00000005"]
    (moved,) = [line for line in out.splitlines() if "moved that checkpoint aside" in line]
    assert "step_00000006/__0_0.distcp fails its sha256 check" in moved and "corrupt-step_00000006" in moved

    assert train(load_config(None, parse_overrides(again))).start_step == 5  # and again: nothing lost


def test_no_valid_checkpoint_refuses_a_fresh_start_unless_asked(
    small_run: list[str], capsys: pytest.CaptureFixture
) -> None:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    args = _run(small_run, "--train.steps", "1", "--checkpoint.keep", "1")
    train(load_config(None, parse_overrides(args)))
    (only,) = list_checkpoints(run_dir)
    (only / "manifest.json").write_text("{not json")
    capsys.readouterr()

    assert main(["train", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("meshlm: ") and "no valid checkpoint to resume from" in line
    assert "corrupt-step_00000001" in line and "--checkpoint.allow_fresh_start true" in line
    assert main(["train", *args]) == 2  # the corrupt one is aside now: still no silent start from scratch

    fresh = train(load_config(None, parse_overrides([*args, "--checkpoint.allow_fresh_start", "true"])))
    assert fresh.start_step == 0 and fresh.final_step == 1
    assert _names(run_dir) == ["corrupt-step_00000001", "step_00000001"]


def test_retention_counts_only_verified_checkpoints(tmp_path: Path) -> None:
    """A corrupt checkpoint older than the newest is found when retention reaches it: moved aside, not
    counted, so `keep` valid ones stay."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    entries = {"model/w": Chunks(torch.Size([2, 2]), [(0, 0)], [torch.zeros(2, 2)])}
    first = CheckpointIO(tmp_path, keep=2, async_save=False, timeout_s=30)
    for step in (1, 2, 3):
        first.save(step, entries, {"step": step})
    _flip_byte(tmp_path / "checkpoints" / "step_00000003" / "trainer.json")  # by another process, later
    said: list[str] = []
    CheckpointIO(tmp_path, keep=2, async_save=False, timeout_s=30, say=said.append).save(4, entries, {"step": 4})
    assert _names(tmp_path) == ["corrupt-step_00000003", "step_00000002", "step_00000004"]
    assert len(said) == 1 and "step_00000003/trainer.json fails its sha256 check" in said[0]


# ---- B: a full disk during a save ---------------------------------------------------------------------------
class _FillingStream:
    """A file whose writes fail with ENOSPC once `room` bytes are written, as on a file system that fills up."""

    def __init__(self, stream: io.IOBase, disk: _Disk) -> None:
        self._stream, self._disk = stream, disk

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self._disk.room < size:
            raise OSError(errno.ENOSPC, "No space left on device", self._stream.name)
        self._disk.room -= size
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Disk:
    """A simulated disk for one save: the files of the step `full_at` staging folder get `room` bytes in all;
    free space reports what is left (the pre-save check and the failure message read it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, full_at: int, room: int) -> None:
        self.room = room
        original = FileSystem.create_stream

        @contextmanager
        def create_stream(fs: FileSystem, path: Any, mode: str) -> Iterator[Any]:
            with original(fs, path, mode) as stream:
                yield _FillingStream(stream, self) if f".tmp-step_{full_at:08d}" in str(path) else stream

        usage = shutil.disk_usage
        monkeypatch.setattr(FileSystem, "create_stream", create_stream)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=self.room))


def _wait_for_background_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each step boundary find the save in flight finished, so where the failure surfaces is exact."""
    poll = CheckpointIO.poll

    def finished_then_poll(self: CheckpointIO, device: Any) -> None:
        if self.pending is not None:
            self.pending[3].join()
        poll(self, device)

    monkeypatch.setattr(CheckpointIO, "poll", finished_then_poll)


def test_full_disk_stops_at_the_next_step_with_one_line_and_resumes_later(
    small_run: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An async save fails in the background: the run stops at the next step boundary (not the next save),
    records the save as failed, frees its folder, and a later run resumes from the previous checkpoint."""
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    args = _run(small_run, "--train.steps", "6", "--checkpoint.every", "2", "--log.every", "1")
    _wait_for_background_saves(monkeypatch)
    with monkeypatch.context() as disk:
        _Disk(disk, full_at=4, room=200_000)
        assert main(["train", *args]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    tmp = run_dir / "checkpoints" / ".tmp-step_00000004"
    assert line.startswith(f"meshlm: checkpoint save of step 4 failed: {tmp}: no space left on device")
    assert "the last checkpoint took" in out and "save of step 4 will probably fail" in out  # warned first
    assert max(r["step"] for r in read_metrics(run_dir, "train")) == 5
    saves = [(r["step"], r["status"]) for r in read_metrics(run_dir, "checkpoint")]
    assert saves == [(2, "committed"), (4, "failed")]
    assert _names(run_dir) == ["step_00000002"]  # the failed save's folder is gone: its space is back

    resumed = train(load_config(None, parse_overrides(args)))  # room again
    assert resumed.start_step == 2 and resumed.final_step == 6


def test_blocking_save_on_a_full_disk_fails_in_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    entries = {"model/w": Chunks(torch.Size([64, 64]), [(0, 0)], [torch.zeros(64, 64)])}
    outcomes: list[tuple[int, str]] = []
    ckpt = CheckpointIO(tmp_path, keep=2, async_save=False, timeout_s=30,
                        record=lambda step, values: outcomes.append((step, values["status"])))  # fmt: skip
    ckpt.save(1, entries, {"step": 1})
    _Disk(monkeypatch, full_at=2, room=1000)
    with pytest.raises(StorageError, match=r"save of step 2 failed: .*\.tmp-step_00000002: no space left on device"):
        ckpt.save(2, entries, {"step": 2})
    assert outcomes == [(1, "committed"), (2, "failed")]
    assert _names(tmp_path) == ["step_00000001"]


def _poll_until_failure(ckpt: CheckpointIO) -> str:
    """Step boundaries until the save in flight fails: 'boundaries:message' (collective, ranks in lockstep)."""
    for boundary in range(100_000):
        try:
            ckpt.poll(torch.device("cpu"))
        except StorageError as e:
            return f"{boundary}:{e}"
    return "never failed"


def _io_error(*_args: object) -> None:
    raise OSError(errno.EIO, "Input/output error", "manifest.json")


def _one_rank_fails_job(root: str) -> list[str]:
    """Step 2: rank 1's shard hits a full disk. Step 3: rank 0's commit hits an I/O error. Every rank must
    stop at the same step boundary with the same line (no rank left waiting in a collective)."""
    rank, run = dist.get_rank(), Path(root)
    entries = {"model/w": Chunks(torch.Size([2, 64]), [(rank, 0)], [torch.zeros(1, 64)])}
    ckpt = CheckpointIO(run, keep=2, async_save=True, timeout_s=30)
    ckpt.save(1, entries, {"step": 1})
    ckpt.wait()
    patch = pytest.MonkeyPatch()  # undone before returning: these ranks serve other tests too
    try:
        _Disk(patch, full_at=2 if rank == 1 else -1, room=0)
        ckpt.save(2, entries, {"step": 2})
        results = [_poll_until_failure(ckpt)]
        patch.undo()
        if rank == 0:
            patch.setattr(CheckpointFolders, "commit", _io_error)
        ckpt.save(3, entries, {"step": 3})
        results.append(_poll_until_failure(ckpt))
    finally:
        patch.undo()
    return [*results, " ".join(_names(run))]


def test_a_failure_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    ranks = run_shared(_one_rank_fails_job, 2, str(tmp_path), timeout=120)
    assert ranks[0][:2] == ranks[1][:2]  # same boundary, same words
    shard, commit = ranks[0][0].split(":", 1)[1], ranks[0][1].split(":", 1)[1]
    assert "save of step 2 failed" in shard and "no space left on device" in shard and "(rank 1)" in shard
    assert "save of step 3 failed" in commit and "manifest.json: I/O error" in commit
    assert ranks[0][2] == "step_00000001"  # both failed saves' folders removed


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.ENOSPC, "no space left on device"), (errno.EACCES, "permission denied"), (errno.EIO, "I/O error")],
)
def test_storage_errors_are_named_with_path_and_cause(tmp_path: Path, code: int, words: str) -> None:
    error = OSError(code, "raw", str(tmp_path / "file"))
    assert storage_cause(error, tmp_path) == f"{tmp_path / 'file'}: {words}"
    opaque = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\nmore")
    assert storage_cause(opaque, tmp_path) == f"{tmp_path}: RuntimeError: {str(opaque).splitlines()[0]}"
    assert "no space left on device" in storage_cause(opaque, tmp_path, needed=shutil.disk_usage(tmp_path).free + 1)


# ---- C: leftovers of failed or interrupted saves ------------------------------------------------------------
def test_start_up_removes_staging_folders_saying_what(tmp_path: Path) -> None:
    for step in (4, 6):
        folder = tmp_path / "checkpoints" / f".tmp-step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"x" * 2**20)
    said: list[str] = []
    store = CheckpointFolders(tmp_path, say=said.append)
    store.remove_staging()
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert said == [
        f"removed .tmp-step_00000004, .tmp-step_00000006 from {tmp_path / 'checkpoints'} (2.0 MB), "
        "left by a failed or interrupted save"
    ]
