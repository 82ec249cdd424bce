"""The run-time hook every strategy that cuts parameters over its mesh dimension returns (tensor and expert
parallel): gathering what it cut, from the placement table (meshlm.parallel.placement.unshard)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshlm.parallel.contract import Applied
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.placement import Placements, unshard


class GatherCuts(Applied):
    """The run-time hook of a strategy that cuts parameters over its mesh dimension (tensor and expert
    parallel alike): `gather_state` makes every tensor cut over `mesh_dim` whole again (`unshard`)."""

    def __init__(self, mesh: Mesh, placements: Placements, mesh_dim: str) -> None:
        self.mesh, self.placements, self.mesh_dim = mesh, placements, mesh_dim

    def gather_state(
        self, state: dict[str, torch.Tensor], params: Mapping[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        return unshard(state, params, self.placements, self.mesh_dim, self.mesh.group(self.mesh_dim))
