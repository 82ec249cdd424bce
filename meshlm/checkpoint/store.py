"""Checkpoint folders in a run directory: atomic, checksummed, found again after any crash.

Layout: `run_dir/checkpoints/step_00000100/` holding DCP's files (`.metadata` and one `__<rank>_0.distcp` per
writing rank), `trainer.json` (step, sampler, optimizer step count, model config, layout) and `manifest.json`
(size and sha256 of every other file). Every rank writes into `.tmp-step_00000100/`; rank 0 writes the
manifest last and renames the folder, so a checkpoint is visible only when complete and an interrupted save
leaves the previous one valid. The folder must be on storage every rank can reach (one node, or a shared
file system across nodes).

`CheckpointFolders` is rank 0's keeper of those folders during training: a corrupt checkpoint is moved aside
(`corrupt-step_00000100/`), never counted by retention and never deleted; staging folders of failed or
interrupted saves are removed at start-up.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshlm.checkpoint.shards import ChunkLoadPlanner, SafeReader
from meshlm.errors import InputError
from meshlm.files import atomic_write, sha256_file

MANIFEST = "manifest.json"
TRAINER = "trainer.json"
STAGING_PREFIX = ".tmp-step_"
CORRUPT_PREFIX = "corrupt-"

# What an errno means to someone whose save or log just failed.
STORAGE_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


class CheckpointError(InputError):
    """A missing, partial, corrupt or incompatible checkpoint, named by file."""


class StorageError(CheckpointError):
    """Reading or writing the run directory failed (disk full, permission, I/O error): one line naming the
    path and the cause."""


def human_size(n: int) -> str:
    """A size for a message: MB, or KB below one MB (so a nearly full disk does not read '0.0 MB')."""
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def storage_cause(error: BaseException, where: Path, needed: int = 0) -> str:
    """`error` from writing under `where`, in words. DCP reports a full disk as torch's 'unexpected pos'
    RuntimeError without an errno, so a failure other than an OSError is called a full disk when the file
    system has less free than the `needed` bytes; otherwise its first line is kept."""
    rank = ""
    if isinstance(error, CheckpointException) and error.failures:
        failed_rank, cause = min(error.failures.items(), key=lambda item: item[0])
        error = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback frames)
        rank = f" (rank {failed_rank})" if dist.is_initialized() and dist.get_world_size() > 1 else ""
    if isinstance(error, OSError) and error.errno is not None:
        words = STORAGE_ERRORS.get(error.errno, error.strerror or os.strerror(error.errno))
        return f"{error.filename or where}: {words}{rank}"
    free = free_bytes(where)
    if free < needed:
        return f"{where}: no space left on device ({human_size(free)} free, needs {human_size(needed)}){rank}"
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{where}: {type(error).__name__}: {first_line}{rank}"


def run_dir_problem(run_dir: Path, error: OSError) -> str:
    """Why the run directory cannot be used, the same words on every rank (not the rank's own file)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        words = "is a file, not a directory"
    elif any(p.exists() and not p.is_dir() for p in run_dir.parents):
        words = f"{next(p for p in run_dir.parents if p.exists() and not p.is_dir())} is a file, not a directory"
    else:
        words = STORAGE_ERRORS.get(error.errno, error.strerror or type(error).__name__)
    return f"log.run_dir {run_dir}: {words}; give a directory this process can create and write"


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_folder(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"{STAGING_PREFIX}{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (staging folders and quarantined ones are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def meshlm_checkpoint(init_from: str | Path) -> Path | None:
    """The checkpoint folder `init_from` names: itself (it holds trainer.json), or a meshlm run directory's
    newest committed one (verified when loaded); None if it is neither."""
    path = Path(init_from)
    if (path / "trainer.json").is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or altered."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint file {manifest_path} is missing (partial save?)")
    try:
        files = json.loads(manifest_path.read_bytes())["files"]
        records = [(name, int(meta["bytes"]), meta["sha256"]) for name, meta in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {manifest_path}: unreadable manifest ({e})") from None
    for name, size, digest in records:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} has {file.stat().st_size} bytes, manifest says {size}")
        if sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint file {file} fails its sha256 check (corrupt)")


def latest_valid_checkpoint(run_dir: Path, warn: Callable[[str], Any] = print) -> Path | None:
    """The newest checkpoint that verifies; corrupt or partial ones are reported by name and skipped (left in
    place: this is for readers such as `meshlm eval`; training moves them aside with CheckpointFolders)."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warn(f"skipping {e}")
    return None


def checkpoint_bytes(path: Path) -> int:
    """Total size of a committed checkpoint, from its manifest (0 if unreadable)."""
    try:
        files = json.loads((path / MANIFEST).read_bytes())["files"]
        return sum(int(meta["bytes"]) for meta in files.values()) + (path / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


class CheckpointFolders:
    """Rank 0's view of a run's checkpoint folders. Each folder is hashed at most once per process (the ones
    this process committed count as verified), so retention can count only valid checkpoints cheaply."""

    def __init__(self, run_dir: Path, say: Callable[[str], Any] = print) -> None:
        self.run_dir = Path(run_dir)
        self.root = checkpoint_dir(run_dir)
        self.say = say
        self.verified: set[str] = set()
        self.last_bytes = 0  # size of the newest checkpoint, for the free-space check before a save

    def is_valid(self, path: Path) -> bool:
        """Verify `path` (once); a corrupt checkpoint is moved aside with a one-line warning."""
        if path.name in self.verified:
            return True
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            self.quarantine(path, str(e))
            return False
        self.verified.add(path.name)
        return True

    def quarantine(self, path: Path, reason: str) -> Path:
        """Move a corrupt checkpoint to `corrupt-step_N` (kept for inspection, invisible to resume and
        retention) and say so."""
        target = path.with_name(CORRUPT_PREFIX + path.name)
        n = 1
        while target.exists():
            target, n = path.with_name(f"{CORRUPT_PREFIX}{path.name}.{n}"), n + 1
        os.replace(path, target)
        self.say(f"{reason}: moved that checkpoint aside to {target} (kept, not used)")
        return target

    def newest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; newer corrupt ones are moved aside on the way."""
        for path in reversed(list_checkpoints(self.run_dir)):
            if self.is_valid(path):
                self.last_bytes = self.last_bytes or checkpoint_bytes(path)
                return path
        return None

    def quarantined(self) -> list[Path]:
        return sorted(self.root.glob(f"{CORRUPT_PREFIX}step_*")) if self.root.is_dir() else []

    def refuse_foreign(self) -> None:
        """Start-up: every `step_*`, staging or quarantined entry under checkpoints/ must be a folder meshlm
        wrote there. A symbolic link or a file under such a name would be read as a checkpoint, renamed or
        replaced by a save (which cannot rename a folder over it: the run stopped at that save), so it is
        refused before any work, named."""
        if not self.root.is_dir():
            return
        prefixes = ("step_", STAGING_PREFIX, CORRUPT_PREFIX)
        for path in sorted(p for p in self.root.iterdir() if p.name.startswith(prefixes)):
            if path.is_symlink() or not path.is_dir():
                what = f"a symbolic link to {os.readlink(path)}" if path.is_symlink() else "not a folder"
                raise CheckpointError(
                    f"{path} is {what}, not a checkpoint folder this run wrote; move it out of {self.root} "
                    "(it may hold only the step_N folders meshlm saves)"
                )

    def remove_staging(self) -> None:
        """Start-up: delete the staging folders of failed or interrupted saves (never committed, so never
        needed), with one line saying what was removed."""
        folders = sorted(self.root.glob(f"{STAGING_PREFIX}*")) if self.root.is_dir() else []
        if not folders:
            return
        size = sum(f.stat().st_size for folder in folders for f in folder.rglob("*") if f.is_file())
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        names = ", ".join(f.name for f in folders)
        self.say(f"removed {names} from {self.root} ({human_size(size)}), left by a failed or interrupted save")

    def resume_point(self, allow_fresh_start: bool) -> Path | None:
        """Start-up: the checkpoint to resume from. When checkpoints were there but none is valid, refuse to
        start from scratch (that would overwrite the run) unless `allow_fresh_start`."""
        path = self.newest_valid()
        corrupt = self.quarantined()
        if path is None and corrupt and not allow_fresh_start:
            raise CheckpointError(
                f"{self.root}: no valid checkpoint to resume from ({len(corrupt)} corrupt, moved aside: "
                f"{', '.join(p.name for p in corrupt)}); pass --checkpoint.allow_fresh_start true to train "
                f"from step 0"
            )
        return path

    def space_warning(self, step: int) -> str | None:
        """A warning when the file system has less free space than the last checkpoint took."""
        if not self.last_bytes:
            return None
        free = free_bytes(self.root)
        if free >= self.last_bytes:
            return None
        return (
            f"warning: {self.root} has {human_size(free)} free but the last checkpoint took "
            f"{human_size(self.last_bytes)}: the save of step {step} will probably fail"
        )

    def commit(self, step: int, files: dict[str, dict[str, Any]], trainer_state: dict[str, Any]) -> Path:
        """Once every rank's files are in the staging folder: write trainer.json and the manifest (`files` are
        the ranks' own records, both written atomically, the manifest last) and rename the folder into place."""
        tmp, final = staging_folder(self.run_dir, step), self.root / f"step_{step:08d}"
        atomic_write(tmp / TRAINER, json.dumps(trainer_state, indent=2))
        files = dict(files)
        for name in (".metadata", TRAINER):
            files[name] = file_record(tmp / name)
        manifest = tmp / MANIFEST
        atomic_write(manifest, json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=2))
        size = sum(r["bytes"] for r in files.values()) + manifest.stat().st_size
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.verified.add(final.name)
        self.last_bytes = size
        return final

    def retain(self, keep: int) -> None:
        """Delete all but the newest `keep` valid checkpoints. Corrupt ones are moved aside, not counted, so
        the newest valid checkpoint is never deleted."""
        kept = 0
        for path in reversed(list_checkpoints(self.run_dir)):
            if kept >= keep:
                shutil.rmtree(path, ignore_errors=True)
                self.verified.discard(path.name)
            elif self.is_valid(path):
                kept += 1


def read_trainer_state(path: Path) -> dict[str, Any]:
    file = path / TRAINER
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({e})") from None


class MetadataOnceReader(SafeReader):
    """SafeReader that reads `.metadata` once: the caller's own checks and DCP's load share that read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs.get("rank") is not None:  # a rank-local metadata file: not the one cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # DCP's load resets the reader after our read
        return self._metadata


# What reading a checkpoint's files raises when they are not what DCP wrote: a refused unpickling (code in
# `.metadata`, a pickled entry, a tensor file that is not weights), a truncated or foreign file.
LOAD_ERRORS = (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, CheckpointException)


def unloadable(path: Path, error: BaseException) -> CheckpointError:
    """The one-line error for checkpoint `path` that raised `error` (one of LOAD_ERRORS) while loading."""
    if isinstance(error, CheckpointError):
        return error
    where = ""
    if isinstance(error, CheckpointException) and error.failures:
        rank, cause = next(iter(sorted(error.failures.items())))
        error = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback frames)
        where = f"rank {rank}: "
    said = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {said[0]}" if said else f"{type(error).__name__} (a file is not what DCP wrote)"
    return CheckpointError(f"checkpoint {path} cannot be loaded: {where}{what}")


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights (HF names) of a verified checkpoint, in this process alone (no process group):
    for generation, evaluation and export."""
    verify_checkpoint(path)
    reader = MetadataOnceReader(path)
    try:
        metadata = reader.read_metadata()
        state = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model/") and isinstance(md, TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # DCP warns that it runs in one process: here that is the point
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), no_dist=True)
    except LOAD_ERRORS as e:
        raise unloadable(path, e) from None
    return {key.removeprefix("model/"): t for key, t in state.items()}


LOCK_NAME = "job.lock"


class RunDirInUse(InputError):
    """Another job holds the run directory's lock."""


class RunLock:
    """One job per run directory: `acquire` takes an exclusive `flock` on `run_dir/job.lock` and writes who holds
    it (pid and host). The kernel drops the lock when its process ends, however it ends, so a lock that can be
    taken while the file still names a holder is a crashed job's: it is taken over, with a line. A live holder
    makes `acquire` raise RunDirInUse (one line naming log.run_dir and the holder). `release` empties the file."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns the line to print when a crashed job's lock was taken over, else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        file = self.path.open("r+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = file.read().strip() or "its holder is starting"
            file.close()
            raise RunDirInUse(
                f"log.run_dir: {self.path.parent} is in use by another job ({holder}; lock {self.path}): one job "
                "per run directory; wait for it to end or set another log.run_dir"
            ) from None
        previous = file.read().strip()
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        file.flush()
        self._file = file
        return f"{self.path}: taken over from a job that ended without releasing it ({previous})" if previous else None

    def release(self) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            self._file.close()  # closing drops the lock
            self._file = None
