"""torch.compile each transformer block, after parallelization (`train.compile`; the last transform of
meshlm.parallel.strategies, so `meshlm.parallelize(model, mesh, {"compile": True})` applies it too).

Per block rather than the whole model: the blocks are identical, so one compiled graph serves them all
(torch.compile treats a module's parameters as inputs), compile time does not grow with depth, and what
lies between blocks (pipeline sends, ZeRO-3 gathers, tensor-parallel collectives at the edges) stays eager.
Compiled after the tensor-parallel and pipeline transforms so the graph is of the modules that actually run.
"""

from __future__ import annotations

import os

from torch import nn

from meshlm.parallel.parallel_plan import ParallelPlan


def compile_blocks(chunks: list[nn.Module], plan: ParallelPlan, backend: str = "inductor") -> int:
    """Compile (in place) every block of this rank's model chunks, found through the plan's pipeline layers;
    returns how many. A model whose plan names no layers is compiled whole, chunk by chunk."""
    if backend == "inductor":
        use_cache_of_cpu_capability()
    layers = plan.pipeline.layers if plan.pipeline is not None else None
    count = 0
    for chunk in chunks:
        container = chunk.get_submodule(layers) if layers else nn.ModuleList([chunk])
        blocks = container.values() if isinstance(container, nn.ModuleDict) else container
        for block in blocks:
            block.compile(backend=backend)
            count += 1
    return count


def use_cache_of_cpu_capability() -> None:
    """Give a run that forces ATEN_CPU_CAPABILITY an inductor cache of its own, unless the user chose a folder.

    Inductor's FX-graph cache key (torch 2.13) leaves out the vector ISA that the capability selects, so code
    generated for AVX2 by an earlier run is reused under `default` and fails to build ("'at::vec' has not been
    declared"); a folder per capability keeps them apart. Importing torch._dynamo already writes the default
    folder into TORCHINDUCTOR_CACHE_DIR, so that value counts as not chosen. (Inductor is imported here, not
    at the top: it costs every trainer process ~0.7 s of start-up, and only compiled runs need it.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    default = default_cache_dir()
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"
