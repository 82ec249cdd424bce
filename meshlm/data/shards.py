"""Token shards: a split's token stream cut into fixed-size `.bin` files, written in parallel, read memory-mapped.

Documents are encoded by worker processes in chunks, but the parent writes the chunks back in corpus order
and cuts a new shard every `shard_tokens` tokens, so the files are byte-identical for any worker count.
Readers see the shards of a split as one array (`TokenShards`); each file is checked against its size and
sha256 in the manifest first, and a bad one is a one-line `DataError` naming it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from meshlm.data.sources import DataError
from meshlm.files import sha256_file

SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens a file: few files, each small enough to copy or re-hash
CHUNK_CHARS = 1 << 20  # characters a worker encodes at once: enough to amortise the pickling, bounded memory
IN_FLIGHT = 2  # chunks queued per worker: keeps every worker busy without reading the corpus ahead


class TokenShards:
    """The shards of one split as a single read-only 1-D token array (len, dtype, integer and slice indexing)."""

    def __init__(self, arrays: list[np.ndarray], dtype: np.dtype) -> None:
        self.arrays = [a for a in arrays if len(a)]
        self.dtype = np.dtype(dtype)
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        out = np.concatenate(self.arrays) if self.arrays else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index: int | slice | np.ndarray) -> np.ndarray:
        if isinstance(index, slice):
            return self[np.arange(len(self))[index]]
        positions = np.asarray(index, dtype=np.int64)
        flat = np.where(positions < 0, positions + len(self), positions).ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range for a split of {len(self)} tokens")
        rows = flat.reshape(positions.shape)
        if rows.ndim == 2 and rows.shape[1] > 1 and np.all(np.diff(rows, axis=1) == 1):
            return np.stack([self._window(int(start), rows.shape[1]) for start in rows[:, 0]])
        shard = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, self.dtype)
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = self.arrays[s][flat[mask] - self.offsets[s]]
        return out.reshape(positions.shape) if positions.ndim else out[0]

    def _window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) by slicing the shards they span (the sampler's rows)."""
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        while length:
            local = start - int(self.offsets[shard])
            part = self.arrays[shard][local : local + length]
            parts.append(part)
            start, length, shard = start + len(part), length - len(part), shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class ShardWriter:
    """Appends one split's tokens to `<split>-NNNNN.bin` files of exactly `shard_tokens` tokens (the last one
    shorter), hashing as it writes; `records` lists each file's name, token count and sha256."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, np.dtype(dtype), shard_tokens
        self.records: list[dict] = []
        self._file = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        while len(tokens):
            if self._file is None:
                self._file = open(self.directory / shard_name(self.split, len(self.records)), "wb")  # noqa: SIM115
            room = self.shard_tokens - self._count
            part, tokens = tokens[:room], tokens[room:]
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(part)
            if self._count == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        self._file.close()
        name = shard_name(self.split, len(self.records))
        self.records.append({"file": name, "tokens": self._count, "sha256": self._hash.hexdigest()})
        self._file, self._hash, self._count = None, hashlib.sha256(), 0

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish_shard()
        return self.records


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode_chunk(tokenizer: Tokenizer, texts: list[str], splits: list[str], eot: int, dtype: str) -> dict:
    """Each split's documents of a chunk, in order, as one token array with `eot` after every document, and
    how many documents each split got."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # tokenizers>=0.20: ~2x faster
    ids: dict[str, list[int]] = {split: [] for split in SPLITS}
    for split, encoding in zip(splits, encode_batch(texts), strict=True):
        ids[split] += encoding.ids
        ids[split].append(eot)
    return {split: (np.array(ids[split], dtype=dtype), splits.count(split)) for split in SPLITS}


def _encode_in_worker(texts: list[str], splits: list[str], eot: int, dtype: str) -> dict:
    return _encode_chunk(_worker_tokenizer, texts, splits, eot, dtype)


def _chunks(documents: Iterable[tuple[str, str]], max_chars: int) -> Iterator[tuple[list[str], list[str]]]:
    """(texts, splits) groups of about `max_chars` characters, in corpus order."""
    texts: list[str] = []
    splits: list[str] = []
    size = 0
    for split, text in documents:
        texts.append(text)
        splits.append(split)
        size += len(text)
        if size >= max_chars:
            yield texts, splits
            texts, splits, size = [], [], 0
    if texts:
        yield texts, splits


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _encoded_chunks(
    chunks: Iterator[tuple[list[str], list[str]]], tokenizer: Tokenizer, eot: int, dtype: str, workers: int
) -> Iterator[dict]:
    """Encoded chunks in input order: in this process for one worker, else a pool with a bounded queue."""
    if workers == 1:
        for texts, splits in chunks:
            yield _encode_chunk(tokenizer, texts, splits, eot, dtype)
        return
    # Forked workers (no re-import); each encodes single-threaded, the processes are the parallelism.
    with _environment(TOKENIZERS_PARALLELISM="false"):
        pool = mp.get_context("fork").Pool(workers, _init_worker, (tokenizer.to_str(),))
    try:
        pending: deque = deque()
        for texts, splits in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (texts, splits, eot, dtype)))
            if len(pending) >= IN_FLIGHT * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


def write_shards(
    directory: Path,
    documents: Iterable[tuple[str, str]],
    tokenizer: Tokenizer,
    eot: int,
    dtype: np.dtype,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
) -> dict:
    """Tokenize `(split, text)` documents into shards under `directory`; returns the manifest's `tokens`,
    `documents` and `shards` entries. The bytes depend only on the documents, tokenizer and shard_tokens."""
    writers = {split: ShardWriter(directory, split, dtype, shard_tokens) for split in SPLITS}
    tokens = dict.fromkeys(SPLITS, 0)
    counts = dict.fromkeys(SPLITS, 0)
    for encoded in _encoded_chunks(_chunks(documents, CHUNK_CHARS), tokenizer, eot, np.dtype(dtype).name, workers):
        for split in SPLITS:
            ids, n_documents = encoded[split]
            writers[split].write(ids)
            tokens[split] += len(ids)
            counts[split] += n_documents
    return {"tokens": tokens, "documents": counts, "shards": {split: writers[split].close() for split in SPLITS}}


def check_shards(directory: Path, manifest: dict, part: tuple[int, int] = (0, 1)) -> None:
    """Every shard is present with the manifest's size; shards i with i % world == rank (`part`) also match
    their sha256, so ranks share the hashing. Raises DataError naming the first bad file."""
    rank, world = part
    itemsize = np.dtype(manifest["dtype"]).itemsize
    index = 0
    for split in SPLITS:
        for record in manifest["shards"][split]:
            path = directory / record["file"]
            if not path.is_file():
                raise DataError(f"data: token shard {path} is missing")
            size = path.stat().st_size
            if size != record["tokens"] * itemsize:
                raise DataError(
                    f"data: token shard {path} has {size} bytes, manifest.json says {record['tokens'] * itemsize} "
                    f"({record['tokens']} tokens)"
                )
            if index % world == rank and sha256_file(path) != record["sha256"]:
                raise DataError(f"data: token shard {path} does not match its sha256 in manifest.json")
            index += 1


def open_split(directory: Path, manifest: dict, split: str) -> TokenShards:
    dtype = np.dtype(manifest["dtype"])
    arrays = [np.memmap(directory / r["file"], dtype=dtype, mode="r") for r in manifest["shards"][split] if r["tokens"]]
    return TokenShards(arrays, dtype)
