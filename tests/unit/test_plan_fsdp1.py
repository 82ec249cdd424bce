"""ZeRO-3 backward gathers under FSDP1's BACKWARD_POST (`--backward-prefetch post`, meshlm.plan.step_time
.dp_collectives), from PyTorch's documented semantics: BACKWARD_PRE "prefetches the next set of parameters
*before* the current set of parameters' gradient computation. This overlaps the *next all-gather* and the
*current gradient computation*"; BACKWARD_POST prefetches them "*after* the current set of parameters'
gradient computation" and overlaps only "the *current reduce-scatter* and the *next gradient computation*"
(torch.distributed.fsdp.BackwardPrefetch). So under POST every unit's backward gather sits between two
gradient computations: none of it hidden, whatever the compute. Composer's FSDP default is BACKWARD_POST.

Mutation: leaving the backward gathers among the hidden ones (dropping the `post` branch) fails both tests."""

from __future__ import annotations

import pytest

from meshlm.model.config import preset
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import Candidate, Workload, hardware, step_time
from meshlm.plan.memory import Assumptions, stage_params
from meshlm.plan.network import group_time
from meshlm.plan.step_time import dp_collectives

H100 = hardware("H100-SXM")


def test_post_exposes_every_backward_gather() -> None:
    """Per micro-batch, 32 units of an 8B model's weights over 64 ranks in 8 nodes: under POST the backward's
    32 unit gathers are never hidden (the first of them was already in the tail, so it leaves it), and the
    hideable part keeps the forward gathers and the reduce-scatters."""
    cfg = preset("llama3-8b")
    w = Workload(cfg, 2048, 64, 1e9, "bf16")
    mesh, layers, psi, m = Layout(dp=64), cfg.n_layers, 7.5e9, 2
    pre = dp_collectives(w, mesh, 3, m, psi, None, layers, "replicas", H100, Assumptions(backward_prefetch="pre"))
    post = dp_collectives(w, mesh, 3, m, psi, None, layers, "replicas", H100, Assumptions(backward_prefetch="post"))
    unit = group_time(H100, "dp", True, "all_gather", psi * 2 / layers, 64, 8)
    assert pre[0] == 0.0
    assert post[0] == pytest.approx(m * layers * unit)
    assert post[1] == pytest.approx(pre[1] - m * layers * unit)
    assert post[2] == pytest.approx(pre[2] - m * unit)


def test_post_lengthens_the_step_by_the_backward_gathers() -> None:
    """With compute to spare (every collective but the tail hidden under PRE), POST adds the backward
    gathers less the one the tail already counted: m·(L − 1) gathers of one unit (the stage's Ψ over its L
    layers, embedding and head riding with them at pp = 1). Compute is unchanged."""
    cfg = preset("llama3-8b")
    w = Workload(cfg, 2048, 64 * 4, 1e9, "bf16")
    s = Candidate(Layout(dp=64), ParallelOptions(zero=3), micro_batch=2, recompute="none")
    pre = step_time(w, s, H100, Assumptions(runtime="megatron"))
    post = step_time(w, s, H100, Assumptions(runtime="megatron", backward_prefetch="post"))
    m, layers = s.micro_batches(w.global_batch), cfg.n_layers
    psi = stage_params(cfg, 1, layers, True, True)
    unit = group_time(H100, "dp", True, "all_gather", psi * 2 / layers, 64, 8)
    assert post.compute == pre.compute
    assert post.dp_comm - pre.dp_comm == pytest.approx(m * (layers - 1) * unit, rel=1e-9)
