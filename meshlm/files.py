"""Files a resume reads, written whole or not at all (run config, trainer state, manifests, tokenizer copies,
export configs), and the sha256 their manifests record: the helpers every layer uses, so they sit at the bottom
with the errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `path` whole or not at all: into a temporary sibling, fsynced, then renamed over `path` (and the
    rename fsynced into the directory). A reader never sees a partial file; a full disk leaves the old one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)  # fsync's full disk names no file: the message should
        raise
    _fsync_directory(path.parent)


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` whole or not at all (as `atomic_write`)."""
    atomic_write(dst, Path(src).read_bytes())


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform or file system that cannot open directories: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    """The hex sha256 of the file at `path`, read `block` bytes at a time (the manifests of checkpoints and of
    data caches record it)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while data := f.read(block):
            h.update(data)
    return h.hexdigest()
