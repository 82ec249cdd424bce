"""`train.compile`: torch.compile each transformer block, after parallelization.

Per block rather than the whole model: the blocks are identical, so one compiled graph serves them all
(torch.compile treats a module's parameters as inputs), compile time does not grow with depth, and what
lies between blocks (pipeline sends, ZeRO-3 gathers, tensor-parallel collectives at the edges) stays eager.
Compiled after the tensor-parallel and pipeline transforms so the graph is of the modules that actually run.
"""

from __future__ import annotations

from torch import nn

from meshlm.parallel.engine import ParallelModel


def compile_blocks(model: ParallelModel, backend: str = "inductor") -> int:
    """Compile (in place) every block this rank holds, found through the plan's pipeline layers; returns how
    many. A model whose plan names no layers is compiled whole, chunk by chunk."""
    layers = model.plan.pipeline.layers if model.plan.pipeline is not None else None
    count = 0
    for chunk in model.chunks:
        container = chunk.get_submodule(layers) if layers else nn.ModuleList([chunk])
        blocks = container.values() if isinstance(container, nn.ModuleDict) else container
        for block in blocks:
            block.compile(backend=backend)
            count += 1
    return count
