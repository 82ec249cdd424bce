"""`meshlm.check` raises no false alarm on a tensor whose gradient is zero in exact arithmetic (issue 47).

The KBias user model (tests/check_models.py) has a biased [Q | K | V] projection: K's bias shifts every score of
a softmax row alike, so its gradient is zero in exact arithmetic and, computed, a sum of rounding errors whose
sign depends on the summation order. In float32 AdamW normalises those into learning-rate-sized steps (m / sqrt(v)
of noise is O(1) once the noise exceeds eps), so the layout's final K bias differed from one process's by
5e-5..8e-5 rel at tp=2 and dp=2 ZeRO-3 while every loss and gradient norm agreed within 1.2e-7. The check's runs
are now float64 (meshlm.check.worker; DataParallel keeps float64 masters, shards and reductions): the noise is
~1e-19, far below eps, and the bias stays put in both runs.

Mutation of the fix: without `torch.set_default_dtype(torch.float64)` in meshlm.check.worker.main the tp=2 and
dp=2 ZeRO-3 cases fail (Δ weights 6.5e-5 and 8.1e-5, first tensor layers.0.attn.qkv.bias); without the float64
masters in DataParallel the dp=2 ZeRO-3 case alone fails (8.1e-5).
"""

from __future__ import annotations

import pytest
import torch
from check_models import KBIAS_PLAN, batches, kbias

import meshlm
from meshlm.check.run import WEIGHT_RTOL, weights_rel

CASES = {
    "tp=2": ("tp=2", {}),
    "dp=2 zero3": ("dp=2", {"zero": 3}),
    "pp=2": ("pp=2", {"micro_batch": 2}),
}


@pytest.mark.slow  # three torchrun starts each (the layout, world 1, the resume): 20-40 s on 2 shared cores
@pytest.mark.parametrize("case", CASES)
def test_a_bias_without_gradient_passes_under_adamw(case: str, tmp_path) -> None:
    layout, parallel = CASES[case]
    report = meshlm.check(kbias, batches(), layout, plan=KBIAS_PLAN, workdir=tmp_path, **parallel)
    assert report.passed and [r.passed for r in report.rows] == [True, True], report.to_json()


def test_a_tensor_at_zero_is_measured_against_the_model_scale() -> None:
    """A zero-initialised bias that gets no gradient stays ~1e-12 in float64 runs: its difference is measured
    against the model's RMS weight over as many elements (an lr-sized step of a bug is far above it), not
    against its own norm (O(1) relative for two runs' 1e-12 noise)."""
    ref = {"w": torch.full((4, 8), 0.05, dtype=torch.float64), "b": torch.full((8,), 1e-12, dtype=torch.float64)}
    noisy = {"w": ref["w"].clone(), "b": -ref["b"]}
    assert weights_rel(noisy, ref)[0] <= WEIGHT_RTOL
    moved = {"w": ref["w"].clone(), "b": ref["b"] + 1e-4}  # one lr-sized step of a bug on the bias
    assert weights_rel(moved, ref)[1].startswith("first tensor whose final weights differ: b")


def adamw_run(dtype: torch.dtype, micro: int) -> dict:
    """Five AdamW steps of KBias in one process at `dtype`, each step's gradient accumulated over `micro`
    micro-batches (another summation order per micro-batch count): the final weights."""
    torch.manual_seed(0)
    model = kbias().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches():
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = model(xs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum") / y.numel()
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_float64_keeps_a_zero_gradient_bias_put_in_any_summation_order() -> None:
    """Why the check runs in float64, in one process (cheap: no torchrun): one batch summed whole or in two
    micro-batches, everything else equal. In float32 the K bias's rounding-level gradient changes sign with the
    order and AdamW turns it into lr-sized steps, beyond WEIGHT_RTOL (measured 4.8e-5 on layers.0.attn.qkv.bias);
    in float64 every tensor agrees within it (8.5e-14)."""
    d32, first32 = weights_rel(adamw_run(torch.float32, 2), adamw_run(torch.float32, 1))
    assert d32 > WEIGHT_RTOL and ".attn.qkv.bias" in first32, (d32, first32)
    d64, first64 = weights_rel(adamw_run(torch.float64, 2), adamw_run(torch.float64, 1))
    assert d64 <= WEIGHT_RTOL and not first64, (d64, first64)
