"""Where each parameter of a parallel model lives: one table, keyed by mesh dimension, filled by the strategies,
read by every reader.

A strategy that cuts a parameter, or changes who reduces, counts or writes it, records it in the build's
`Placements` (meshlm.parallel.contract.Build, then `ParallelModel.placements`); nothing is stored on the
tensor. The readers ask the table and nothing else, and none of them names a strategy:
  * data parallel / ZeRO (meshlm.parallel.dp.data_parallel): which mesh group reduces a gradient (`grad_group`:
    it buckets parameters by it) and which weights get a flat buffer of their own (`pp_tied`);
  * gradient-norm clipping and checkpoint writing (`ParallelModel.clip_grad_norm_`, `local_shards`): `counted`;
  * checkpoint boxes (meshlm.checkpoint.state) and materialisation of meta models (meshlm.parallel.materialize):
    `shards`, where this rank's tensor sits in the full one;
  * unsharding for `full_state_dict` / export (`unshard`, run by each cutting strategy's gather_state hook for
    its own mesh dimension): `on(mesh_dim)`.
Materialisation moves a meta parameter's record onto the real one.

A record (`Placement`) says, for this rank's tensor:
  * `shards`: one `Shard(mesh_dim, dim, pieces)` per mesh dimension that cuts it (in mesh order, pp .. tp),
    like torch's DTensor placements: a mesh dimension without a shard holds it whole (torch's `Replicate()`).
    A shard is `Shard(dim)` plus its `pieces`: a fused projection's slice is several runs of the full tensor
    ([Q | K | V] keeps q_r | k_r | v_r), which torch's `Shard(dim)` cannot describe;
  * `grad_group`: the mesh group (meshlm.parallel.mesh.Mesh.group) whose ranks hold the same values and
    average its gradient: "replicas" (dp × ep × cp) unless the strategy that cut it records another (expert
    parallel records "expert_replicas", dp × cp: only those ranks hold the same experts);
  * `pp_tied`: both the first and the last pipeline stage hold it (a tied embedding and head): its gradient
    is also summed over the two ends, so data parallel gives it a flat buffer of its own, laid out alike on
    both ends;
  * `counted`: this rank counts its gradient-norm term and writes it to a checkpoint. False where another
    rank holds the same values and does (tp ranks > 0 for a weight every tp rank holds whole or a KV head
    replicated over ranks; the last pipeline stage for a tied weight), so that over the world every element
    is counted and written once. The copies over `grad_group` are data parallel's business (one primary per
    buffer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from meshlm.parallel.mesh import DIMS

REPLICAS = "replicas"  # the mesh group that averages the gradient of a weight no strategy records otherwise


@dataclass(frozen=True)
class Shard:
    """Cut over mesh dimension `mesh_dim` along tensor dim `dim`: local run i is the full tensor's
    [pieces[i][0], pieces[i][0] + pieces[i][1]) along `dim`."""

    mesh_dim: str
    dim: int
    pieces: tuple[tuple[int, int], ...]

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
    """How this rank holds one parameter (see the module docstring); the default is whole, reduced over
    "replicas", counted here and untied."""

    shards: tuple[Shard, ...] = ()
    grad_group: str = REPLICAS
    counted: bool = True
    pp_tied: bool = False

    def on(self, mesh_dim: str) -> Shard | None:
        """The shard over `mesh_dim`, or None where every rank of that dimension holds the tensor whole."""
        return next((s for s in self.shards if s.mesh_dim == mesh_dim), None)

    def cut(self, shard: Shard) -> Placement:
        """This placement with `shard` added (replacing one over the same mesh dimension), in mesh order."""
        kept = [s for s in self.shards if s.mesh_dim != shard.mesh_dim] + [shard]
        order = {d: i for i, d in enumerate(DIMS)}
        return replace(self, shards=tuple(sorted(kept, key=lambda s: order.get(s.mesh_dim, len(DIMS)))))


class Placements:
    """The placement table of one parallel model: a record per parameter object, held weakly (a parameter
    a strategy drops, or materialisation replaces, leaves the table with it)."""

    def __init__(self) -> None:
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __getitem__(self, param: torch.Tensor) -> Placement:
        return self._records.get(param, Placement())

    def record(self, param: torch.Tensor, shard: Shard | None = None, **fields: object) -> None:
        """Add `shard` to `param`'s record and set its fields (grad_group=, counted=, pp_tied=), keeping the rest."""
        place = replace(self[param], **fields)
        self._records[param] = place.cut(shard) if shard is not None else place

    def move(self, old: torch.Tensor, new: torch.Tensor, shard: Shard | None = None, **fields: object) -> None:
        """`new` takes `old`'s place in the model: `old`'s record (with `shard` added and `fields` set) is now
        `new`'s."""
        self._records[new] = self._records.pop(old, Placement())
        self.record(new, shard, **fields)

    def grad_groups(self) -> list[str]:
        """Every mesh group some record names as its gradient group, the default first."""
        return list(dict.fromkeys([REPLICAS, *(place.grad_group for place in self._records.values())]))

    def __len__(self) -> int:
        return len(self._records)


@torch.no_grad()
def unshard(
    state: dict[str, torch.Tensor],
    params: Mapping[str, torch.Tensor] | nn.Module,
    placements: Placements,
    mesh_dim: str,
    group: dist.ProcessGroup,
) -> dict[str, torch.Tensor]:
    """`state` with every tensor cut over `mesh_dim` made whole along it, on every rank of `group` (that
    dimension's), each run placed where its Shard says. `params` (or a module's named parameters) maps names
    to the parameters whose records say which names are cut. Collective: every rank of `group` must call it
    with the same names. Runs held by several ranks (a KV head replicated over tp ranks) are kept once."""
    if isinstance(params, nn.Module):
        params = dict(params.named_parameters(remove_duplicate=False))
    size = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    cut = sorted(n for n in state if n in params and placements[params[n]].on(mesh_dim) is not None)
    every: list[dict | None] = [None] * size
    dist.all_gather_object(every, {n: placements[params[n]].on(mesh_dim) for n in cut}, group=group)
    full = dict(state)
    for name in cut:
        t = state[name]
        dim = every[0][name].dim
        parts = [torch.empty_like(t, device=device) for _ in range(size)]
        dist.all_gather(parts, t.to(device).contiguous(), group=group)
        runs = {}  # full start -> the run's values
        for rank in range(size):
            for local, start, length in every[rank][name].runs(0, parts[rank].shape[dim]):
                runs[start] = parts[rank].narrow(dim, local, length)
        full[name] = torch.cat([runs[s] for s in sorted(runs)], dim=dim).to(t.device)
    return full
