"""What the parallel engine needs to know beyond the mesh: its own options, not the run config.

The run config's `[parallel]` section (meshlm.config.ParallelSection) validates the user's input and builds
one of these (`ParallelSection.options()`); the library API builds one from `parallelize`'s arguments. The
engine never imports the config, so `meshlm.parallel` sits below it in meshlm's layers (tests/test_layers.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ParallelOptions:
    """How each strategy runs on the mesh (field meanings: the README's `parallel.*` config reference)."""

    zero: int = 0
    zero_shard_size: int | None = None
    zero_param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    zero_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    bucket_mb: float = 25.0
    sequence_parallel: bool = False
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = "1f1b"
    virtual_stages: int = 1
    cp_attention: Literal["ring", "ulysses"] = "ring"

    @classmethod
    def of(cls, source: object) -> ParallelOptions:
        """`source` itself if it is ParallelOptions, else its same-named attributes (e.g. a ParallelSection)."""
        if isinstance(source, cls):
            return source
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})
