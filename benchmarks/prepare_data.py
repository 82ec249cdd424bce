"""Tokenizing a corpus into shards: one process (the inline path: `tokenizers`' own threads) vs N processes.

Trains the byte-level tokenizer once, then runs meshlm.data.shards.write_shards over the same documents with
each worker count, checks that every run wrote byte-identical shards, and prints wall time, throughput and
the ratio to one process. Tokenizer training is timed separately: both paths pay it once, serially.

    .venv/bin/python benchmarks/prepare_data.py                        # stdlib, 8 M characters, 1 and 2 workers
    .venv/bin/python benchmarks/prepare_data.py --max-chars 0 --workers 1 4 16
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from meshlm.config import DataSection
from meshlm.data.dataset import is_val_document, token_dtype
from meshlm.data.shards import write_shards
from meshlm.data.sources import iter_documents
from meshlm.data.tokenizer import eot_id, train_tokenizer


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="stdlib")
    parser.add_argument("--max-chars", type=int, default=8_000_000, help="0 = the whole source")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    cfg = DataSection(source=args.source, max_chars=args.max_chars or None)
    docs = list(iter_documents(cfg))
    labelled = [("val" if is_val_document(i, cfg.val_fraction) else "train", d) for i, d in enumerate(docs)]
    chars = sum(map(len, docs))
    start = time.perf_counter()
    tokenizer = train_tokenizer((d for s, d in labelled if s == "train"), args.vocab_size)
    train_s = time.perf_counter() - start
    print(f"{args.source}: {chars / 1e6:.1f} M characters, {len(docs)} documents; {os.cpu_count()} CPUs")
    print(f"tokenizer training ({args.vocab_size} tokens, once, either path): {train_s:.1f} s\n")
    rows, reference = [], None
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            written = write_shards(Path(out), labelled, tokenizer, eot_id(tokenizer), token_dtype(args.vocab_size),
                                   workers, shard_tokens=1 << 22)  # fmt: skip
            seconds = time.perf_counter() - start
            digest = _digest(Path(out))
        reference = reference or digest
        rows.append((workers, seconds, digest == reference, sum(written["tokens"].values())))
    baseline = next((s for w, s, _, _ in rows if w == 1), rows[0][1])
    print("| workers | encode + write (s) | M chars / s | speed vs 1 process | shards identical |")
    print("|---:|---:|---:|---:|---|")
    for workers, seconds, same, tokens in rows:
        print(
            f"| {workers} | {seconds:.2f} | {chars / seconds / 1e6:.2f} | {baseline / seconds:.2f}× "
            f"| {'yes' if same else 'NO'} ({tokens:,} tokens) |"
        )


if __name__ == "__main__":
    main()
