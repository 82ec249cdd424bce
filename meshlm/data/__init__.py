"""meshlm.data: text sources, a byte-level BPE tokenizer, cached token shards and deterministic batches, and
supervised fine-tuning examples (meshlm.data.sft).

The names below are imported on first use (batches and datasets need torch; the CLI's parser does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.lazy import lazy_attributes

if TYPE_CHECKING:
    from meshlm.data.dataset import TokenData, prepare_data, prepare_data_shared
    from meshlm.data.sampler import GlobalBatchSampler, eval_batches
    from meshlm.data.sft import IGNORE, SFTData, iter_examples
    from meshlm.data.shards import TokenShards
    from meshlm.data.sources import DataError, iter_documents
    from meshlm.data.tokenizer import EOT, decode, encode, eot_id, train_tokenizer

__all__ = [
    "EOT",
    "IGNORE",
    "DataError",
    "GlobalBatchSampler",
    "SFTData",
    "TokenData",
    "TokenShards",
    "decode",
    "encode",
    "eot_id",
    "eval_batches",
    "iter_documents",
    "iter_examples",
    "prepare_data",
    "prepare_data_shared",
    "train_tokenizer",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(("TokenData", "prepare_data", "prepare_data_shared"), "meshlm.data.dataset"),
        **dict.fromkeys(("GlobalBatchSampler", "eval_batches"), "meshlm.data.sampler"),
        "TokenShards": "meshlm.data.shards",
        **dict.fromkeys(("IGNORE", "SFTData", "iter_examples"), "meshlm.data.sft"),
        **dict.fromkeys(("DataError", "iter_documents"), "meshlm.data.sources"),
        **dict.fromkeys(("EOT", "decode", "encode", "eot_id", "train_tokenizer"), "meshlm.data.tokenizer"),
    },
)
