"""Sharded saves and resharding loads of a whole training state, blocking or asynchronous.

Every rank writes only the boxes it holds (DCP deduplicates replicas), so save time and file size per rank
shrink with sharding. An async save copies this rank's state into one reusable staging buffer (pinned host
memory on GPU), returns, and writes from a background thread while training goes on; a new save first waits
for the previous one, so staging never exceeds one copy of the rank's state. DCP's planning collectives use a
gloo group of their own, so the background thread never interleaves with training's collectives.
"""

from __future__ import annotations

import datetime
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshlm.checkpoint.shards import ChunkLoadPlanner, Chunks, ChunkSavePlanner, SafeReader
from meshlm.checkpoint.store import CheckpointError, commit_checkpoint, file_record, staging_folder

Entries = dict[str, Any]  # key -> Chunks or a plain tensor
ALIGN = 64  # staging offsets stay aligned for every dtype


class Checkpointer:
    """Saves `Entries` to `run_dir/checkpoints/step_N` and loads them back under any layout. Collective."""

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        async_save: bool,
        timeout_s: float,
        on_shard_written: Callable[[int], None] | None = None,
    ) -> None:
        """`on_shard_written(step)` runs after this rank's files of a save are written, before the commit
        (where fault-injection tests kill a rank mid-save)."""
        self.on_shard_written = on_shard_written
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.async_save = async_save
        self.pending: tuple[Future, threading.Thread] | None = None
        self.staging: torch.Tensor | None = None
        self.staging_bytes = 0  # high-water mark of the staging buffer, for the benchmark and the docs

    # ---- saving -----------------------------------------------------------------------------------------
    def save(self, step: int, entries: Entries, trainer_state: dict[str, Any]) -> float:
        """Start (async) or do (blocking) the save of step `step`; return the seconds training was held."""
        start = time.perf_counter()
        self.wait()
        entries = {**entries, **self._rng_entries()}
        if not self.async_save:
            self._write(step, entries, trainer_state)
        else:
            self.pending = self._in_background(self._write, step, self._stage(entries), trainer_state)
        return time.perf_counter() - start

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

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed on every rank; re-raise its failure."""
        if self.pending is not None:
            (pending, thread), self.pending = self.pending, None
            thread.join()  # not only the result: no writer thread may outlive a clean exit (gloo aborts)
            pending.result()

    def _rng_entries(self) -> Entries:
        entries = {f"rng/cpu/{self.rank}": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            entries[f"rng/cuda/{self.rank}"] = torch.cuda.get_rng_state()
        return entries

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

    def _write(self, step: int, entries: Entries, trainer_state: dict[str, Any]) -> None:
        tmp = staging_folder(self.run_dir, step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        dcp.save(entries, storage_writer=writer, planner=ChunkSavePlanner(), process_group=self.group)
        if self.on_shard_written is not None:
            self.on_shard_written(step)
        own = {p.name: file_record(p) for p in tmp.glob(f"__{self.rank}_*.distcp")}
        records: list[dict | None] | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(own, records, dst=0, group=self.group)
        if self.rank == 0:
            files = {name: rec for r in records for name, rec in r.items()}
            commit_checkpoint(self.run_dir, step, files, trainer_state, self.keep)
        dist.barrier(group=self.group)

    # ---- loading ----------------------------------------------------------------------------------------
    def load(self, path: Path, entries: Entries) -> None:
        """Fill `entries` in place from checkpoint `path`, whatever layout wrote it; restore this rank's RNG
        when the checkpoint has a state for it (same world size)."""
        reader = SafeReader(path)
        try:
            saved = reader.read_metadata().state_dict_metadata
            missing = sorted(k for k in entries if k not in saved)
            anywhere = torch.tensor([len(missing)])
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.group)  # every rank stops, or none
            if anywhere.item():
                what = f"entry {missing[0]}" if missing else "entries another rank needs"
                raise CheckpointError(f"checkpoint {path} lacks {what}; was it written for another model?")
            rng = {k: torch.empty(saved[k].size, dtype=torch.uint8) for k in self._rng_entries() if k in saved}
            dcp.load({**entries, **rng}, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=self.group)
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, CheckpointException) as e:
            if isinstance(e, CheckpointError):
                raise
            if isinstance(e, CheckpointException) and e.failures:
                rank, cause = next(iter(sorted(e.failures.items())))
                cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback frames)
                e = f"rank {rank}: {type(cause).__name__}: {cause}"
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {str(e).splitlines()[0]}") from None
        for key, state in rng.items():
            if key.startswith("rng/cpu/"):
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state)
