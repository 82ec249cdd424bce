"""How one tensor-parallel rank holds a parameter: the one description every reader uses.

Tensor parallelism (meshlm.parallel.tensor_parallel) tags each parameter it slices with a `TPShard`; the
readers — gradient-norm counting and checkpoint writing (meshlm.parallel.engine), checkpoint boxes
(meshlm.checkpoint.state), materialisation of meta models (meshlm.parallel.materialize), unsharding for
`full_state_dict` / export (`unshard_state_dict`) — ask `tp_shard(param)` and nothing else.

Along `dim` the rank's tensor is the concatenation of `pieces`, each a run `(full_start, length)` of the full
tensor: one piece for a plain column or row slice, one per block for a fused projection ([Q | K | V] keeps
q_r | k_r | v_r). Replicated parameters (norms, learned positions) carry no TPShard.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

ATTR = "_meshlm_tp_shard"


@dataclass(frozen=True)
class TPShard:
    """Along `dim`, local run i is the full tensor's [pieces[i][0], pieces[i][0] + pieces[i][1]). `counted` is
    False on a rank whose copy another rank also holds and counts (the 2nd.. copies of a KV head replicated
    over ranks): the global gradient norm and checkpoint writing skip it there."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    counted: bool = True

    def runs(self, local_start: int, length: int) -> Iterator[tuple[int, int, int]]:
        """The local range [local_start, local_start + length) along `dim` as (local start, full start, length)
        runs, each inside one piece."""
        end, at = local_start + length, 0
        for full_start, size in self.pieces:
            lo, hi = max(local_start, at), min(end, at + size)
            if lo < hi:
                yield lo, full_start + lo - at, hi - lo
            at += size

    @property
    def contiguous(self) -> bool:
        return len(self.pieces) == 1


def tp_shard(param: nn.Parameter) -> TPShard | None:
    """The parameter's TPShard; None when every tp rank holds it whole."""
    return getattr(param, ATTR, None)


def set_tp_shard(param: nn.Parameter, shard: TPShard) -> None:
    setattr(param, ATTR, shard)
