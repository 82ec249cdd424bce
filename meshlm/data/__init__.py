"""meshlm.data: text sources, a byte-level BPE tokenizer, cached token shards and deterministic batches."""

from meshlm.data.dataset import TokenData, prepare_data, prepare_data_shared
from meshlm.data.sampler import GlobalBatchSampler, eval_batches
from meshlm.data.shards import TokenShards
from meshlm.data.sources import DataError, iter_documents
from meshlm.data.tokenizer import EOT, decode, encode, eot_id, train_tokenizer

__all__ = [
    "EOT",
    "DataError",
    "GlobalBatchSampler",
    "TokenData",
    "TokenShards",
    "decode",
    "encode",
    "eot_id",
    "eval_batches",
    "iter_documents",
    "prepare_data",
    "prepare_data_shared",
    "train_tokenizer",
]
