"""Where training text comes from: the interpreter's standard library, local files, or Hugging Face.

Every source yields documents in a fixed order, so the same config always produces the same corpus,
the same tokenizer and the same token files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshlm.config import DataSection
from meshlm.errors import InputError
from meshlm.faults import fault_point

FILE_SUFFIXES = (".txt", ".jsonl", ".md", ".py")
VALID_SOURCES = "'stdlib', a .txt/.jsonl file, a folder of .txt/.jsonl/.md/.py files, or 'hf:NAME[:CONFIG]'"


class DataError(InputError):
    """A data problem, phrased as one line that names the file and what would be valid."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def describe_source(cfg: DataSection) -> str:
    return f"stdlib ({stdlib_root()})" if cfg.source == "stdlib" else cfg.source


def check_source(cfg: DataSection) -> None:
    """Refuse a local data.source that does not exist: cheap (no torch), so the CLI calls it before its heavy
    imports and a mistyped path is one line within a second."""
    local = not (cfg.source == "stdlib" or cfg.source.startswith("hf:"))
    if local and not (Path(cfg.source).is_dir() or Path(cfg.source).is_file()):
        found = f"is {kind}" if (kind := special_kind(Path(cfg.source))) else "not found"
        raise DataError(f"data.source: {cfg.source} {found}; valid: {VALID_SOURCES}")
    check_cache_dir(cfg)


def special_kind(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder (a named pipe, whose reading
    would block, a socket, a device), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = [(stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character "
             "device"), (stat.S_ISBLK, "a block device")]  # fmt: skip
    return next((name for test, name in kinds if test(mode)), None)


def check_cache_dir(cfg: DataSection) -> None:
    """data.cache_dir must be a folder or creatable as one: refuse, naming it, a path that is (or lies under)
    something else."""
    for path in (Path(cfg.cache_dir), *Path(cfg.cache_dir).parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                where = "is" if path == Path(cfg.cache_dir) else f"lies under {path}, which is"
                raise DataError(
                    f"data.cache_dir: {cfg.cache_dir} {where} not a folder; valid: a folder (created if missing) "
                    "for the tokenizer and token files"
                )
            return


def source_files(cfg: DataSection) -> list[Path]:
    """The files a local source reads, in corpus order (empty for Hugging Face sources)."""
    check_source(cfg)
    if cfg.source.startswith("hf:"):
        return []
    if cfg.source == "stdlib":
        return _walk(stdlib_root(), (".py",), skip={"site-packages", "dist-packages", "__pycache__"})
    path = Path(cfg.source)
    if path.is_dir():
        return _walk(path, FILE_SUFFIXES, skip=set())
    if path.suffix not in (".txt", ".jsonl"):
        raise DataError(f"data.source: {path} is not a .txt or .jsonl file; valid: {VALID_SOURCES}")
    return [path]


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str]) -> list[Path]:
    """Files under root with one of the suffixes, sorted by relative path; `skip` folders are not entered."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder, f) for f in files if f.endswith(suffixes)]
    if special := next(((p, kind) for p in found if (kind := special_kind(p))), None):
        raise DataError(f"data.source: {special[0]} is {special[1]}, not a file; remove it from {root}")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def source_fingerprint(cfg: DataSection) -> str:
    """Hash of the sources' identities: file paths, sizes and mtimes, so an edited file changes it.

    Hugging Face sources are identified by name, split and field only (their content is not re-checked).
    """
    h = hashlib.sha256(f"{cfg.source}\0{cfg.text_field}\0{cfg.hf_split}\0".encode())
    for p in source_files(cfg):
        st = p.stat()
        h.update(f"{p.absolute()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def iter_documents(cfg: DataSection) -> Iterator[str]:
    """All documents of the source in a fixed order, capped at cfg.max_chars characters in total."""
    docs = _hf_documents(cfg) if cfg.source.startswith("hf:") else _file_documents(cfg)
    budget = cfg.max_chars
    found = False
    for doc in docs:
        if not doc:
            continue
        if budget is not None:
            doc = doc[:budget]
            budget -= len(doc)
        found = True
        yield doc
        # tests: a SIGTERM while the corpus is being read, on the global rank torchrun announces (read here as
        # meshlm.parallel.distributed.env_rank does: that module imports torch, which reading text does not need)
        fault_point("tokenize", int(os.environ.get("RANK", "0")), 0)
        if budget == 0:
            return
    if not found:
        raise DataError(f"data.source: no text found in {describe_source(cfg)}; valid: {VALID_SOURCES}")


def _file_documents(cfg: DataSection) -> Iterator[str]:
    """A .jsonl line is a document, a .txt file holds documents separated by blank lines, other files are one."""
    stdlib = cfg.source == "stdlib"
    for path in source_files(cfg):
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, cfg.text_field)
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            if stdlib:  # a few stdlib test files are deliberately not UTF-8
                continue
            raise DataError(f"data.source: {path} is not UTF-8 text; convert it or remove it") from None
        if path.suffix == ".txt":
            yield from (part.strip() for part in re.split(r"\n\s*\n", text))
        else:
            yield text


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    expected = f'each line must be a JSON object with a string field "{field}" (data.text_field)'
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{lineno}: not valid JSON; {expected}") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: no string field {field!r}; {expected}")
            yield text


def _hf_documents(cfg: DataSection) -> Iterator[str]:
    """`hf:NAME` or `hf:NAME:CONFIG`, split cfg.hf_split; `datasets` stays an optional dependency."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source: {cfg.source} needs Hugging Face datasets: pip install meshlm[hf]") from None
    name, _, config = cfg.source.removeprefix("hf:").partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=cfg.hf_split)
    except Exception as e:  # unreachable hub, unknown name, config or split: the library's reason in one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"data.source: {cfg.source} (split {cfg.hf_split!r}) cannot be loaded: {reason}; valid: an existing "
            f"Hugging Face dataset 'hf:NAME[:CONFIG]' reachable from here or in the local cache, or a local file"
        ) from None
    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"data.text_field: {cfg.source} split {cfg.hf_split!r} has no field {cfg.text_field!r}; "
            f"valid: {', '.join(ds.column_names)}"
        )
    for record in ds:
        yield record[cfg.text_field]
