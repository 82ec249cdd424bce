"""Sharded saves and resharding loads of a whole training state, blocking or asynchronous.

Every rank writes only the boxes it holds (DCP deduplicates replicas), so save time and file size per rank
shrink with sharding. An async save copies this rank's state into one reusable staging buffer (pinned host
memory on GPU), returns, and writes from a background thread while training goes on; a new save first waits
for the previous one, so staging never exceeds one copy of the rank's state. DCP's planning collectives use a
gloo group of their own, so the background thread never interleaves with training's collectives.

A failed save (disk full, permission, I/O error) stops the run: every rank raises `StorageError`, one line
naming the path and the cause, at the first step boundary after the failure (`poll`), its staging folder
is removed and the previous checkpoint stays the one to resume from. Saves are not retried in-process: a
restart (torchrun `--max-restarts`) is the retry, and it resumes from that previous checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshlm.checkpoint.rng import Streams, saved_world_size
from meshlm.checkpoint.shards import ChunkLoadPlanner, Chunks, ChunkSavePlanner
from meshlm.checkpoint.store import (
    LOAD_ERRORS,
    CheckpointError,
    CheckpointFolders,
    MetadataOnceReader,
    StorageError,
    file_record,
    staging_folder,
    storage_cause,
    unloadable,
)

Entries = dict[str, Any]  # key -> Chunks or a plain tensor
_OPEN: weakref.WeakSet[CheckpointIO] = weakref.WeakSet()  # for finish_saves
ALIGN = 64  # staging offsets stay aligned for every dtype


def finish_saves() -> None:
    """Wait for every background save still in flight in this process (collective), e.g. one a script started
    with `Checkpoints.save` and never waited for: its writer thread runs DCP's collectives on the checkpoint
    group, so the process group must outlive it, and a daemon thread still in C++ when the interpreter
    finalizes aborts the process (measured: a 2-rank script ending right after an async save aborted in 2 of
    3 runs and committed no checkpoint). Re-raises a save's failure."""
    for checkpointer in list(_OPEN):
        checkpointer.wait()


def _nbytes(entries: Entries) -> int:
    tensors = [v for e in entries.values() for v in (e.views if isinstance(e, Chunks) else [e])]
    return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointIO:
    """The collective reads and writes of checkpoints: saves `Entries` to `run_dir/checkpoints/step_N` and loads
    them back under any layout. `meshlm.Checkpoints` (api.py) is the library's door to it for a ParallelModel and
    its optimizer; rank 0 keeps the folders themselves with a `CheckpointFolders` (store.py)."""

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        async_save: bool,
        timeout_s: float,
        on_shard_written: Callable[[int], None] | None = None,
        say: Callable[[str], Any] = print,
        record: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        """`on_shard_written(step)` runs after this rank's files of a save are written, before the commit
        (where fault-injection tests kill a rank mid-save). `say` prints rank 0's one-line notices (corrupt
        checkpoints moved aside, leftovers removed, low disk space); `record(step, values)` receives each
        save's outcome once known (status 'committed' or 'failed'), for the metrics."""
        self.on_shard_written = on_shard_written
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.rank = dist.get_rank()
        self.say = say if self.rank == 0 else (lambda _message: None)
        self.record = record or (lambda _step, _values: None)
        self.store = CheckpointFolders(self.run_dir, self.say)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.async_save = async_save
        self.pending: tuple[int, float, Future, threading.Thread] | None = None  # step, held_s, result, writer
        self.staging: torch.Tensor | None = None
        self.staging_bytes = 0  # high-water mark of the staging buffer, for the benchmark and the docs
        _OPEN.add(self)

    # ---- finding checkpoints ----------------------------------------------------------------------------
    def resume_point(self, resume: bool, allow_fresh_start: bool) -> Path | None:
        """Start-up: rank 0 refuses entries it did not write (CheckpointFolders.refuse_foreign), removes staging
        folders of failed or interrupted saves, moves corrupt checkpoints aside and picks the newest valid one
        (`resume`), or refuses to start over corrupt ones; every rank gets the same answer."""

        def pick() -> Path | None:
            self.store.refuse_foreign()
            self.store.remove_staging()
            return self.store.resume_point(allow_fresh_start) if resume else None

        return self._from_rank0(pick)

    def newest_valid(self) -> Path | None:
        """The newest valid checkpoint (corrupt ones moved aside), chosen by rank 0 for every rank."""
        return self._from_rank0(self.store.newest_valid)

    def _from_rank0(self, choose: Callable[[], Path | None]) -> Path | None:
        answer: list[str | CheckpointError | None] = [None]
        if self.rank == 0:
            try:
                path = choose()
                answer = [str(path) if path else None]
            except CheckpointError as e:  # every rank stops with rank 0's reason
                answer = [e]
            except OSError as e:
                answer = [StorageError(f"checkpoints cannot be read: {storage_cause(e, self.store.root)}")]
        dist.broadcast_object_list(answer, src=0, group=self.group)
        if isinstance(answer[0], CheckpointError):
            raise answer[0]
        return Path(answer[0]) if answer[0] else None

    # ---- saving -----------------------------------------------------------------------------------------
    def save(self, step: int, entries: Entries, trainer_state: dict[str, Any]) -> float:
        """Start (async) or do (blocking) the save of step `step`; return the seconds training was held.
        Raises StorageError if this save (blocking) or the previous one failed."""
        start = time.perf_counter()
        self.wait()
        if self.rank == 0 and (warning := self.store.space_warning(step)):
            self.say(warning)
        entries = {**entries, **Streams.current().entries(self.rank)}  # meshlm.checkpoint.rng
        if not self.async_save:
            try:
                self._write(step, entries, trainer_state)
                error = None
            except StorageError as e:
                error = e
            held_s = time.perf_counter() - start
            self._finish(step, held_s, held_s, error)
            return held_s
        staged = self._stage(entries)
        future, thread = self._in_background(self._write, step, staged, trainer_state)
        held_s = time.perf_counter() - start
        self.pending = (step, held_s, future, thread)
        return held_s

    @staticmethod
    def _in_background(fn: Any, *args: Any) -> tuple[Future, threading.Thread]:
        """Run fn in a daemon thread: a save stuck on a dead peer must not keep a failing process alive."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

        thread = threading.Thread(target=run, name="meshlm-checkpoint", daemon=True)
        thread.start()
        return future, thread

    def poll(self, device: torch.device) -> None:
        """At a step boundary, while a save is in flight (collective): record it once it has finished on every
        rank; if it failed on any rank, raise its StorageError on every rank in this same step."""
        if self.pending is None:
            return
        future = self.pending[2]
        failed = future.done() and future.exception() is not None
        flags = torch.tensor([float(failed), float(not future.done())], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() or not flags[1].item():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed on every rank and record it; re-raise its
        failure."""
        if self.pending is not None:
            (step, held_s, future, thread), self.pending = self.pending, None
            thread.join()  # not only the result: no writer thread may outlive a clean exit (gloo aborts)
            error = future.exception()
            self._finish(step, held_s, None if error else future.result(), error)

    def _finish(self, step: int, held_s: float, write_s: float | None, error: BaseException | None) -> None:
        """Record a save's outcome for the metrics; re-raise its failure."""
        if error is None:
            outcome = {"status": "committed", "held_s": held_s, "write_s": write_s, "staging_bytes": self.staging_bytes}
            self.record(step, outcome)
            return
        # On a full disk the metrics may refuse this record too: the save's own error is the one to show.
        with contextlib.suppress(StorageError):
            self.record(step, {"status": "failed", "held_s": held_s, "error": str(error)})
        raise error

    def _stage(self, entries: Entries) -> Entries:
        """Copies of every view in one reusable host buffer, so training may change the originals."""
        tensors = [v for e in entries.values() for v in (e.views if isinstance(e, Chunks) else [e])]
        total = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
        if self.staging is None or self.staging.numel() < total:
            pin = any(t.is_cuda for t in tensors)
            self.staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
            self.staging_bytes = total
        offset = 0

        def take(view: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            n = view.numel() * view.element_size()
            out = self.staging[offset : offset + n].view(view.dtype).view(view.shape)
            out.copy_(view, non_blocking=True)
            offset += -(-n // ALIGN) * ALIGN
            return out

        staged = {k: e.staged(take) if isinstance(e, Chunks) else take(e) for k, e in entries.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    def _write(self, step: int, entries: Entries, trainer_state: dict[str, Any]) -> float:
        """Write, hash and commit one save; return its seconds. A failure anywhere reaches every rank through
        the next collective (none is left waiting for a peer that gave up) and raises StorageError."""
        start = time.perf_counter()
        tmp = staging_folder(self.run_dir, step)
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = storage_cause(e, tmp)
        self._raise_if(step, tmp, self._from_rank0_error(error))
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        try:
            dcp.save(entries, storage_writer=writer, planner=ChunkSavePlanner(), process_group=self.group)
        except CheckpointException as e:  # DCP's failures reach every rank together; rank 0's words win
            cause = storage_cause(e, tmp, _nbytes(entries)) if self.rank == 0 else None
            self._raise_if(step, tmp, self._from_rank0_error(cause))
        if self.on_shard_written is not None:
            self.on_shard_written(step)
        try:
            own: dict[str, Any] | str = {p.name: file_record(p) for p in tmp.glob(f"__{self.rank}_*.distcp")}
        except OSError as e:
            own = storage_cause(e, tmp)
        records: list[Any] | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(own, records, dst=0, group=self.group)
        if self.rank == 0:
            error = next((r for r in records if isinstance(r, str)), None)
            if error is None:
                try:
                    self.store.commit(step, {name: rec for r in records for name, rec in r.items()}, trainer_state)
                except OSError as e:
                    error = storage_cause(e, tmp)
        self._raise_if(step, tmp, self._from_rank0_error(error))
        if self.rank == 0:
            try:
                self.store.retain(self.keep)
            except OSError as e:  # the save itself is committed; old checkpoints just stay
                self.say(f"warning: retention of old checkpoints failed: {storage_cause(e, self.store.root)}")
        return time.perf_counter() - start

    def _from_rank0_error(self, error: str | None) -> str | None:
        shared = [error]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        return shared[0]

    def _raise_if(self, step: int, tmp: Path, error: str | None) -> None:
        """Every rank raises the same failure; rank 0 removes the staging folder so the space comes back."""
        if error is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(
            f"checkpoint save of step {step} failed: {error}; stopping (the previous checkpoint stays valid)"
        )

    # ---- loading ----------------------------------------------------------------------------------------
    def load(self, path: Path, entries: Entries, restore_streams: bool = True) -> Streams | None:
        """Fill `entries` in place from checkpoint `path`, whatever layout wrote it; return this rank's random
        streams when the checkpoint was saved by as many ranks as this run has (else None: the rule of
        meshlm.checkpoint.rng), and with `restore_streams` set them now. `.metadata` is read once."""
        reader = MetadataOnceReader(path)
        try:
            saved = reader.read_metadata().state_dict_metadata
            missing = sorted(k for k in entries if k not in saved)
            anywhere = torch.tensor([len(missing)])
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.group)  # every rank stops, or none
            if anywhere.item():
                what = f"entry {missing[0]}" if missing else "entries another rank needs"
                raise CheckpointError(f"checkpoint {path} lacks {what}; was it written for another model?")
            same_world = saved_world_size(saved) == dist.get_world_size()
            keys = [f"rng/{kind}/{self.rank}" for kind in ("cpu", "cuda")]
            rng = {k: torch.empty(saved[k].size, dtype=torch.uint8) for k in keys if same_world and k in saved}
            dcp.load({**entries, **rng}, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=self.group)
        except LOAD_ERRORS as e:
            raise unloadable(path, e) from None
        if not rng:
            return None
        streams = Streams(rng[keys[0]], rng.get(keys[1]))
        if restore_streams:
            streams.restore()
        return streams
