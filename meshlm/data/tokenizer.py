"""Byte-level BPE (GPT-2 style) trained on the corpus itself, so any vocabulary size from 257 up works.

Byte-level means every string round-trips exactly: unseen characters fall back to their UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.data.sources import DataError

EOT = "<|endoftext|>"  # the one special token: appended after every document
MIN_VOCAB = 257  # 256 byte tokens + EOT


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens; deterministic given the texts."""
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"model.vocab_size ({vocab_size}) must be at least {MIN_VOCAB} for a byte-level tokenizer "
            f"(256 bytes + {EOT})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOT],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    return tokenizer.token_to_id(EOT)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def decode(tokenizer: Tokenizer, ids: Iterable[int]) -> str:
    """Inverse of `encode`; EOT is kept as text so that decode(encode(x)) == x for every string."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)
