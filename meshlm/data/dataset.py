"""Tokenize a corpus once into token shards, cached on disk and shared by every run and rank.

Cache layout: `<cache_dir>/<key>/{tokenizer.json, train-00000.bin, ..., val-00000.bin, ..., manifest.json}`,
where the key hashes everything that changes the tokens and the manifest lists each shard's tokens and sha256
(meshlm.data.shards). A directory is built in a temporary sibling and moved into place with one `os.replace`,
so readers never see a half-written cache. Training builds a missing cache inline on rank 0 (one process);
`meshlm prepare-data` builds it ahead of time with many. One that disagrees with its manifest is rebuilt if
it was built inline, and refused with one line naming the file if `meshlm prepare-data` built it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from meshlm.config import DataSection
from meshlm.data.shards import SHARD_TOKENS, SPLITS, TokenShards, check_shards, open_split, write_shards
from meshlm.data.sources import DataError, describe_source, iter_documents, source_files, source_fingerprint
from meshlm.data.tokenizer import EOT, eot_id, train_tokenizer
from meshlm.files import atomic_write, sha256_file

if TYPE_CHECKING:
    import torch

    from meshlm.data.sampler import GlobalBatchSampler
    from meshlm.data.sft import SFTData

FORMAT_VERSION = 2
PREPARED = "prepare-data"  # the manifest's `builder` for caches `meshlm prepare-data` made (else "inline")
INLINE_LIMIT_BYTES = 1 << 26  # above this much text, tokenizing inline behind a barrier deserves a warning
PROGRESS_CHARS = 1 << 24  # while tokenizing, a line per this much text encoded (a silent log looks hung)
log = logging.getLogger(__name__)


@dataclass
class TokenData:
    """The token streams of both splits (memory-mapped shards, read-only) and the tokenizer that produced them."""

    train: TokenShards
    val: TokenShards
    tokenizer: Tokenizer
    directory: Path
    manifest: dict

    def sampler(self, seq_len: int, global_batch: int, seed: int) -> GlobalBatchSampler:
        """The deterministic global batches of the train split (meshlm.data.sampler)."""
        from meshlm.data.sampler import GlobalBatchSampler  # torch: imported when batches are wanted

        return GlobalBatchSampler(self.train, seq_len, global_batch, seed)

    def eval_batches(
        self, seq_len: int, batch: int, n_batches: int, rank: int = 0, world: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation batches (this rank's rows of each)."""
        from meshlm.data.sampler import eval_batches

        return eval_batches(self.val, seq_len, batch, n_batches, rank, world)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def cache_key(cfg: DataSection, vocab_size: int, tokenizer_file: Path | None = None) -> str:
    """Short hash of everything the token files depend on; any change gives a fresh cache directory (a given
    tokenizer by its content's sha256)."""
    inputs = {
        "format": FORMAT_VERSION,
        "sources": source_fingerprint(cfg),
        "max_chars": cfg.max_chars,
        "vocab_size": vocab_size,
        "val_fraction": cfg.val_fraction,
    }
    if tokenizer_file is not None:
        inputs["tokenizer_sha256"] = sha256_file(tokenizer_file)
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def prepare_data(
    cfg: DataSection,
    vocab_size: int,
    tokenizer_file: Path | None = None,
    workers: int = 1,
    builder: str = "inline",
    shard_tokens: int = SHARD_TOKENS,
) -> TokenData | SFTData:
    """Load the cached tokens for this config, training the tokenizer (or using `tokenizer_file`, an HF
    tokenizer.json) and tokenizing with `workers` processes first if needed. `builder` is recorded in the
    manifest; `meshlm prepare-data` passes PREPARED, and rebuilds a damaged cache that training refuses.
    With data.format = "sft", the tokenized examples instead (meshlm.data.sft; one process)."""
    if cfg.format == "sft":
        from meshlm.data.sft import prepare_sft  # it builds on this module

        return prepare_sft(cfg, vocab_size, tokenizer_file, builder)
    if tokenizer_file is not None:
        check_tokenizer(tokenizer_file, vocab_size)
    key = cache_key(cfg, vocab_size, tokenizer_file)
    directory = Path(cfg.cache_dir) / key
    manifest = cached_manifest(directory, key, builder, _read_manifest)
    if manifest is None:
        manifest = _build(cfg, vocab_size, directory, key, tokenizer_file, workers, builder, shard_tokens)
    return _open(cfg, directory, manifest)


def cached_manifest(directory: Path, key: str, builder: str, read_manifest: Callable[[Path, str], dict]) -> dict | None:
    """The manifest of the cache folder `directory` when it exists and reads back whole; None when it is absent
    or corrupt (named in a warning: the caller rebuilds it). A cache `meshlm prepare-data` built is never
    rebuilt by training (`builder` ≠ PREPARED): damaged, it is one line saying so."""
    if not directory.exists():
        return None
    try:
        return read_manifest(directory, key)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if builder != PREPARED and built_by(directory) == PREPARED:
            raise DataError(damaged_message(directory, e)) from None
        log.warning("data cache %s is corrupt (%s); rebuilding it", directory, e)
        return None


def cache_tokenizer(
    out: Path, tokenizer_file: Path | None, vocab_size: int, texts: Iterable[str]
) -> tuple[Tokenizer, int]:
    """The cache's tokenizer.json in `out` and its document separator id: a copy of `tokenizer_file` (an HF
    tokenizer), or a BPE tokenizer of `vocab_size` trained on `texts` (read only then)."""
    if tokenizer_file is None:
        tokenizer = train_tokenizer(texts, vocab_size)
        tokenizer.save(str(out / "tokenizer.json"))
        return tokenizer, eot_id(tokenizer)
    shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    return tokenizer, document_separator(tokenizer_file, tokenizer)


def built_by(directory: Path) -> str | None:
    """The manifest's `builder`, or None when there is no readable manifest."""
    try:
        return json.loads((directory / "manifest.json").read_text()).get("builder")
    except (OSError, ValueError, AttributeError):
        return None


def damaged_message(directory: Path, error: Exception) -> str:
    cause = str(error) if isinstance(error, DataError) else f"data: {directory / 'manifest.json'}: {error}"
    return f"{cause}; rebuild the prepared corpus: meshlm prepare-data with this config"


def _open(cfg: DataSection, directory: Path, manifest: dict) -> TokenData:
    """Memory-map a verified cache's shards; each split must hold at least one training sequence."""
    data = TokenData(
        train=open_split(directory, manifest, "train"),
        val=open_split(directory, manifest, "val"),
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


def check_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """A given tokenizer.json, which must load and whose ids must all be below the model's vocab_size."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass for unreadable or invalid files
        raise DataError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0] if str(e) else e})") from None
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise DataError(
            f"{path}: {tokenizer.get_vocab_size(with_added_tokens=True)} tokens do not fit the model's vocab_size "
            f"{vocab_size}; use the tokenizer the checkpoint was trained with"
        )
    return tokenizer


def document_separator(path: Path, tokenizer: Tokenizer) -> int:
    """The token appended after each document with a given tokenizer: the eos_token of the tokenizer_config.json
    beside it, else meshlm's EOT if the vocabulary has it."""
    config_path = path.parent / "tokenizer_config.json"
    name = EOT
    if config_path.is_file():
        try:
            eos = json.loads(config_path.read_bytes()).get("eos_token")
        except (ValueError, AttributeError):
            raise DataError(f"{config_path}: invalid JSON object") from None
        name = eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else EOT
    token = tokenizer.token_to_id(name) if isinstance(name, str) else None
    if token is None:
        raise DataError(
            f"{path}: no document separator: {name!r} is not in the vocabulary; set eos_token in "
            f"{config_path.name} to a token it has"
        )
    return token


def is_val_document(index: int, val_fraction: float) -> bool:
    """Evenly spaced document-level hold-out: exactly floor(n * val_fraction) of the first n documents."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def _read_manifest(directory: Path, key: str, part: tuple[int, int] = (0, 1)) -> dict:
    """The manifest of a complete cache directory; raises if any file disagrees with it (of the shards' sha256,
    only this `part` = (rank, world) share is checked)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest["key"] != key or manifest["format"] != FORMAT_VERSION:
        raise ValueError(f"manifest.json is for key {manifest['key']} format {manifest['format']}")
    check_shards(directory, manifest, part)
    if sha256_file(directory / "tokenizer.json") != manifest["tokenizer_sha256"]:
        raise ValueError("tokenizer.json does not match the manifest's sha256")
    return manifest


def _build(
    cfg: DataSection,
    vocab_size: int,
    directory: Path,
    key: str,
    tokenizer_file: Path | None = None,
    workers: int = 1,
    builder: str = "inline",
    shard_tokens: int = SHARD_TOKENS,
) -> dict:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(directory.parent, key)
    try:
        _tokenize_into(tmp, cfg, vocab_size, key, tokenizer_file, workers, builder, shard_tokens)
        _install(tmp, directory, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _read_manifest(directory, key)


def staging_dir(parent: Path, key: str) -> Path:
    """A fresh folder in `parent` to build cache `key` in, then moved into place. mkdtemp makes it 0700; it gets
    the mode a plain mkdir would (0777 less the umask), so a shared cache is as readable as its parent allows."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


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


def _tokenize_into(
    out: Path,
    cfg: DataSection,
    vocab_size: int,
    key: str,
    tokenizer_file: Path | None = None,
    workers: int = 1,
    builder: str = "inline",
    shard_tokens: int = SHARD_TOKENS,
) -> None:
    source = describe_source(cfg)
    start = time.perf_counter()
    if tokenizer_file is None:
        print(f"tokenizing {source}: training a {vocab_size}-token BPE tokenizer on its train split first",
              flush=True)  # fmt: skip
    train_docs = (doc for i, doc in enumerate(iter_documents(cfg)) if not is_val_document(i, cfg.val_fraction))
    tokenizer, eot = cache_tokenizer(out, tokenizer_file, vocab_size, train_docs)

    dtype = token_dtype(vocab_size)
    documents = (
        ("val" if is_val_document(i, cfg.val_fraction) else "train", doc) for i, doc in enumerate(iter_documents(cfg))
    )
    written = write_shards(out, _reporting(documents, source, start), tokenizer, eot, dtype, workers, shard_tokens)
    tokens, documents = written["tokens"], written["documents"]
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
        "tokenizer_sha256": sha256_file(out / "tokenizer.json"),
        "eot_id": eot,
        "dtype": dtype.name,
        "tokens": tokens,
        "documents": documents,
        "shard_tokens": shard_tokens,
        "shards": written["shards"],
        "builder": builder,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")  # last: the cache's commit
    print(f"tokenized {source} in {time.perf_counter() - start:.0f} s with {workers} process(es): "
          f"{tokens['train']:,} train and {tokens['val']:,} validation tokens", flush=True)  # fmt: skip


def _reporting(documents: Iterable[tuple[str, str]], source: str, start: float) -> Iterator[tuple[str, str]]:
    """`documents` unchanged, with a line each time another PROGRESS_CHARS characters have been read."""
    read, count, due = 0, 0, PROGRESS_CHARS
    for split, text in documents:
        yield split, text
        read, count = read + len(text), count + 1
        if read >= due:
            due += PROGRESS_CHARS * ((read - due) // PROGRESS_CHARS + 1)
            print(f"tokenizing {source}: {read / 1e6:,.1f} M characters, {count:,} documents, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip


def prepare_data_shared(cfg: DataSection, vocab_size: int, tokenizer_file: Path | None = None) -> TokenData | SFTData:
    """`prepare_data` on every rank of the default process group (collective).

    A ready cache (from `meshlm prepare-data` or an earlier run) is memory-mapped by every rank directly,
    with the shards' sha256 checks split over the ranks and one exchange of the verdicts: nobody waits on
    tokenization. Without one, rank 0 tokenizes inline while the others wait at a barrier bounded by
    `parallel.timeout_s`, which is why real corpora are prepared first.
    """
    import torch.distributed as dist

    if cfg.format == "sft":
        from meshlm.data.sft import prepare_sft_shared

        return prepare_sft_shared(cfg, vocab_size, tokenizer_file)
    if tokenizer_file is not None:
        check_tokenizer(tokenizer_file, vocab_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    key = cache_key(cfg, vocab_size, tokenizer_file)
    directory = Path(cfg.cache_dir) / key
    manifest, problem = None, None
    if (directory / "manifest.json").is_file():
        try:
            manifest = _read_manifest(directory, key, (rank, world))
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = damaged_message(directory, e) if built_by(directory) == PREPARED else str(e)
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, (manifest is not None, problem))
    prepared_problem = next((p for _, p in verdicts if p and built_by(directory) == PREPARED), None)
    if prepared_problem:
        raise DataError(prepared_problem)
    if all(ready for ready, _ in verdicts):
        return _open(cfg, directory, manifest)
    if rank == 0:
        _warn_if_large(cfg)
        data = prepare_data(cfg, vocab_size, tokenizer_file)
    dist.barrier()
    if dist.get_rank() != 0:
        data = prepare_data(cfg, vocab_size, tokenizer_file)
    return data


def _warn_if_large(cfg: DataSection) -> None:
    """Say, before tokenizing inline, when the corpus is big enough that the others' barrier may time out."""
    size = sum(p.stat().st_size for p in source_files(cfg)) if not cfg.source.startswith("hf:") else None
    if cfg.max_chars is not None:
        size = cfg.max_chars if size is None else min(size, cfg.max_chars)
    if size is None or size > INLINE_LIMIT_BYTES:
        amount = "a corpus of unknown size" if size is None else f"{size / 1e6:.0f} MB of text"
        log.warning(
            "data: rank 0 now tokenizes %s (%s) in one process while the other ranks wait at a barrier bounded "
            "by parallel.timeout_s; for a corpus this size run `meshlm prepare-data` with this config first",
            amount,
            describe_source(cfg),
        )
