"""Context parallel's run-time hook: this rank's load-balanced part of every sequence
(meshlm.parallel.contract.Applied)."""

from __future__ import annotations

import torch

from meshlm.parallel.contract import Applied
from meshlm.parallel.cp import attention
from meshlm.parallel.mesh import Mesh


class ContextParallelHooks(Applied):
    def __init__(self, mesh: Mesh) -> None:
        self.size, self.rank = mesh.size("cp"), mesh.rank("cp")

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        return attention.shard_sequence(batch, self.size, self.rank)  # looked up per call: tests patch it
