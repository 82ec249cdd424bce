"""Tokenize a corpus once into flat token files, cached on disk and shared by every run and rank.

Cache layout: `<cache_dir>/<key>/{tokenizer.json, train.bin, val.bin, manifest.json}`, where the key hashes
everything that changes the tokens. A directory is built in a temporary sibling and moved into place with
one `os.replace`, so readers never see a half-written cache; one that disagrees with its manifest is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from meshlm.config import DataSection
from meshlm.data.sources import DataError, describe_source, iter_documents, source_fingerprint
from meshlm.data.tokenizer import eot_id, train_tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "val")
log = logging.getLogger(__name__)


@dataclass
class TokenData:
    """The token streams of both splits (memory-mapped, read-only) and the tokenizer that produced them."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    directory: Path
    manifest: dict


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def cache_key(cfg: DataSection, vocab_size: int) -> str:
    """Short hash of everything the token files depend on; any change gives a fresh cache directory."""
    inputs = {
        "format": FORMAT_VERSION,
        "sources": source_fingerprint(cfg),
        "max_chars": cfg.max_chars,
        "vocab_size": vocab_size,
        "val_fraction": cfg.val_fraction,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def prepare_data(cfg: DataSection, vocab_size: int) -> TokenData:
    """Load the cached tokens for this config, training the tokenizer and tokenizing first if needed."""
    key = cache_key(cfg, vocab_size)
    directory = Path(cfg.cache_dir) / key
    manifest = None
    if directory.exists():
        try:
            manifest = _read_manifest(directory, key)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("data cache %s is corrupt (%s); rebuilding it", directory, e)
    if manifest is None:
        manifest = _build(cfg, vocab_size, directory, key)
    dtype = np.dtype(manifest["dtype"])
    data = TokenData(
        train=np.memmap(directory / "train.bin", dtype=dtype, mode="r"),
        val=np.memmap(directory / "val.bin", dtype=dtype, mode="r"),
        tokenizer=Tokenizer.from_file(str(directory / "tokenizer.json")),
        directory=directory,
        manifest=manifest,
    )
    for split in SPLITS:
        n = len(getattr(data, split))
        if n < cfg.seq_len + 1:
            raise DataError(
                f"data: the {split} split of {manifest['source']} has {n} tokens, fewer than data.seq_len + 1 "
                f"= {cfg.seq_len + 1}; use more text (data.max_chars), a larger data.val_fraction or a "
                "smaller data.seq_len"
            )
    return data


def is_val_document(index: int, val_fraction: float) -> bool:
    """Evenly spaced document-level hold-out: exactly floor(n * val_fraction) of the first n documents."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_manifest(directory: Path, key: str) -> dict:
    """The manifest of a complete cache directory; raises if any file disagrees with it."""
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest["key"] != key or manifest["format"] != FORMAT_VERSION:
        raise ValueError(f"manifest.json is for key {manifest['key']} format {manifest['format']}")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        size = (directory / f"{split}.bin").stat().st_size
        if size != manifest["tokens"][split] * itemsize:
            raise ValueError(f"{split}.bin has {size} bytes, manifest says {manifest['tokens'][split]} tokens")
    if _sha256(directory / "tokenizer.json") != manifest["tokenizer_sha256"]:
        raise ValueError("tokenizer.json does not match the manifest's sha256")
    return manifest


def _build(cfg: DataSection, vocab_size: int, directory: Path, key: str) -> dict:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=directory.parent))
    try:
        _tokenize_into(tmp, cfg, vocab_size, key)
        _install(tmp, directory, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _read_manifest(directory, key)


def _install(tmp: Path, directory: Path, key: str) -> None:
    """Move the finished directory into place; if another process got there first with a valid one, keep it."""
    try:
        os.replace(tmp, directory)
        return
    except OSError:
        pass  # the target exists: either a concurrent builder's finished cache or the corrupt one
    try:
        _read_manifest(directory, key)
        return
    except (OSError, ValueError, KeyError, TypeError):
        trash = Path(tempfile.mkdtemp(prefix=f".{key}.old-", dir=directory.parent))
        os.replace(directory, trash / key)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, directory)
    except OSError:
        _read_manifest(directory, key)  # a concurrent builder won the race; fine if its cache is valid


def _tokenize_into(out: Path, cfg: DataSection, vocab_size: int, key: str) -> None:
    source = describe_source(cfg)
    start = time.perf_counter()
    log.info("training a %d-token BPE tokenizer on %s", vocab_size, source)
    train_docs = (doc for i, doc in enumerate(iter_documents(cfg)) if not is_val_document(i, cfg.val_fraction))
    tokenizer = train_tokenizer(train_docs, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))

    dtype, eot = token_dtype(vocab_size), eot_id(tokenizer)
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # tokenizers>=0.20: ~2x faster
    tokens = dict.fromkeys(SPLITS, 0)
    documents = dict.fromkeys(SPLITS, 0)
    with open(out / "train.bin", "wb") as train_file, open(out / "val.bin", "wb") as val_file:
        files = {"train": train_file, "val": val_file}
        for chunk in _chunks(enumerate(iter_documents(cfg))):
            ids: dict[str, list[int]] = {split: [] for split in SPLITS}
            encodings = encode_batch([doc for _, doc in chunk])
            for (i, _), encoding in zip(chunk, encodings, strict=True):
                split = "val" if is_val_document(i, cfg.val_fraction) else "train"
                ids[split] += encoding.ids
                ids[split].append(eot)
                documents[split] += 1
            for split in SPLITS:
                files[split].write(np.array(ids[split], dtype=dtype).tobytes())
                tokens[split] += len(ids[split])
    if documents["val"] == 0:
        raise DataError(
            f"data: {source} has only {documents['train']} document(s), too few to hold out "
            f"data.val_fraction = {cfg.val_fraction} of them for validation; add documents or raise data.val_fraction"
        )

    manifest = {
        "format": FORMAT_VERSION,
        "key": key,
        "source": source,
        "sources_hash": source_fingerprint(cfg),
        "max_chars": cfg.max_chars,
        "val_fraction": cfg.val_fraction,
        "vocab_size": vocab_size,
        "tokenizer_sha256": _sha256(out / "tokenizer.json"),
        "eot_id": eot,
        "dtype": dtype.name,
        "tokens": tokens,
        "documents": documents,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("tokenized %s in %.1fs: %s tokens", source, time.perf_counter() - start, tokens)


def _chunks(items: Iterable[tuple[int, str]], max_chars: int = 1 << 22) -> Iterator[list[tuple[int, str]]]:
    """Groups of documents big enough for encode_batch to keep every core busy, small enough for memory."""
    chunk: list[tuple[int, str]] = []
    size = 0
    for item in items:
        chunk.append(item)
        size += len(item[1])
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def prepare_data_shared(cfg: DataSection, vocab_size: int) -> TokenData:
    """`prepare_data` on every rank of the default process group: rank 0 tokenizes (once, cached on disk),
    then the others read the same cache (collective)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        data = prepare_data(cfg, vocab_size)
    dist.barrier()
    if dist.get_rank() != 0:
        data = prepare_data(cfg, vocab_size)
    return data
