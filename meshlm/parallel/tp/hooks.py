"""Tensor parallel's run-time hook: gathering the state it sharded (meshlm.parallel.contract.Applied)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshlm.parallel.contract import Applied
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.placement import Placements
from meshlm.parallel.tp import sharding


class TensorParallelHooks(Applied):
    """The full tensors from every tp rank's shards, where the placement table says each run sits."""

    def __init__(self, mesh: Mesh, placements: Placements) -> None:
        self.mesh, self.placements = mesh, placements

    def gather_state(
        self, state: dict[str, torch.Tensor], params: Mapping[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        return sharding.unshard_state_dict(state, params, self.placements, self.mesh.group("tp"))
