"""Where each parameter of a parallel model lives: one table, filled by the strategies, read by every reader.

A strategy that cuts a parameter records it in the build's `Placements` (meshlm.parallel.contract.Build,
then `ParallelModel.placements`); nothing is stored on the tensor. The readers — data parallel / ZeRO (which
group reduces a gradient, which weights get a flat buffer of their own), gradient-norm clipping and checkpoint
writing (which rank counts and writes a replicated term), checkpoint boxes (meshlm.checkpoint.state),
materialisation of meta models (meshlm.parallel.materialize) and unsharding for `full_state_dict` / export —
ask the table and nothing else. Materialisation moves a meta parameter's record onto the real one.

A record (`Placement`) says, for this rank's tensor:
  * `tp`: its tensor-parallel slice (a `TPShard`), None when every tp rank holds it whole (norms);
  * `ep`: its expert-parallel slice of stacked experts (a `TPShard` along dim 0), None for dense weights; an
    expert weight's gradient is reduced over the ranks holding the same experts (mesh group "dp_cp"), every
    other over all data replicas;
  * `pp_tied`: both the first and the last pipeline stage hold it (a tied embedding and head): its gradient
    is summed over the two ends (its own flat buffer under data parallel);
  * `counted`: this rank counts its gradient-norm term and writes it to a checkpoint. False where another
    rank holds the same values and does (tp ranks > 0 for a weight every tp rank holds whole or a KV head
    replicated over ranks; the last pipeline stage for a tied weight), so that over the world every element
    is counted and written once. Data parallel replicas are its own business (one primary per buffer).
A slice is not a torch DTensor `Shard(dim)`: a fused projection's slice is several runs of the full tensor
([Q | K | V] keeps q_r | k_r | v_r), which `TPShard.pieces` describes and `Shard` cannot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.utils.weak import WeakIdKeyDictionary


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


@dataclass(frozen=True)
class Placement:
    """How this rank holds one parameter (see the module docstring); the default is whole and untied."""

    tp: TPShard | None = None
    ep: TPShard | None = None
    pp_tied: bool = False
    counted: bool = True

    @property
    def shards(self) -> tuple[TPShard, ...]:
        """Where this rank's tensor sits in the full one, one slice per sharded dim: its ep slice (dim 0 of
        stacked experts), then its tp slice (any dim; under ep × tp an expert weight has both)."""
        return tuple(shard for shard in (self.ep, self.tp) if shard is not None)

    @property
    def expert(self) -> bool:
        """Its gradient is reduced over the ranks holding the same experts, not over every data replica."""
        return self.ep is not None


class Placements:
    """The placement table of one parallel model: a record per parameter object, held weakly (a parameter
    a strategy drops, or materialisation replaces, leaves the table with it)."""

    def __init__(self) -> None:
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __getitem__(self, param: torch.Tensor) -> Placement:
        return self._records.get(param, Placement())

    def record(self, param: torch.Tensor, **fields: object) -> None:
        """Set fields of `param`'s record (tp=, ep=, pp_tied=, counted=), keeping the others."""
        self._records[param] = replace(self[param], **fields)

    def move(self, old: torch.Tensor, new: torch.Tensor, **fields: object) -> None:
        """`new` takes `old`'s place in the model: its record (with `fields` changed) is now `new`'s."""
        record = self._records.pop(old, None)
        if record is not None or fields:
            self._records[new] = replace(record or Placement(), **fields)

    def __len__(self) -> int:
        return len(self._records)
