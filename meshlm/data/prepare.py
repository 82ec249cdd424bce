"""`meshlm prepare-data`: tokenize a run's corpus ahead of training, with many processes, into the token cache.

The cache is the one training reads (meshlm.data.dataset), so a run with the same [data] and [model] sections
memory-maps the shards on every rank at once instead of waiting while rank 0 tokenizes behind a barrier.
"""

from __future__ import annotations

import time

from meshlm.config import Config
from meshlm.data.dataset import PREPARED, prepare_data
from meshlm.data.shards import SHARD_TOKENS


def prepare_corpus(cfg: Config, workers: int, shard_tokens: int = SHARD_TOKENS) -> str:
    """Build (or verify and keep) the token cache of `cfg`; returns the one-line summary the command prints."""
    from meshlm.model.pretrained import init_tokenizer

    start = time.perf_counter()
    data = prepare_data(
        cfg.data, cfg.model.build().vocab_size, init_tokenizer(cfg.model.init_from), workers, PREPARED, shard_tokens
    )
    m = data.manifest
    if cfg.data.format == "sft":
        return (
            f"{data.directory}: {m['examples']['train']} train + {m['examples']['val']} val examples "
            f"({m['tokens']['train']} + {m['tokens']['val']} tokens, {m['labels']['train']} + {m['labels']['val']} "
            f"of them labels, {m['template']}), built by {m['builder']} {m['created']}, ready in "
            f"{time.perf_counter() - start:.1f}s; runs with this [data] and [model] read it directly"
        )
    shards = sum(len(m["shards"][split]) for split in m["shards"])
    return (
        f"{data.directory}: {m['tokens']['train']} train + {m['tokens']['val']} val tokens "
        f"({m['documents']['train']} + {m['documents']['val']} documents) in {shards} shard(s), "
        f"built by {m['builder']} {m['created']}, ready in {time.perf_counter() - start:.1f}s; "
        "runs with this [data] and [model] memory-map it directly"
    )
