"""Expert parallel's run-time hook: gathering the stacked experts it sharded (meshlm.parallel.contract.Applied)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshlm.parallel.contract import Applied
from meshlm.parallel.ep import experts
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.placement import Placements


class ExpertParallelHooks(Applied):
    def __init__(self, mesh: Mesh, placements: Placements) -> None:
        self.mesh, self.placements = mesh, placements

    def gather_state(
        self, state: dict[str, torch.Tensor], params: Mapping[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        return experts.unshard_experts(state, params, self.placements, self.mesh.group("ep"))
