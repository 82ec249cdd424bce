"""GEMM rates by shape (meshlm.plan.gemm): each matmul of a layer priced as a kernel of its own shape.

The kernel model is checked against published measurements (XLA's sm_90 bf16 GEMM table and the MAMF table
of stas00/ml-engineering, docs/planner.md "GEMM rates by shape"), and the layer's and the step's use of it
against figures worked by hand from the formula the page states. Mutations that fail here: no fixed kernel
time (KERNEL_OVERHEAD_S = 0: the small-kernel and the XLA tests), no memory bound (the skinny GEMM), expert
rows not multiplied by ep (the MoE test), stage_slots ignoring the shape efficiency (the step test).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from meshlm.model.config import PRESETS
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import Candidate, Workload, hardware, step_time
from meshlm.plan.gemm import dense_gemms, gemm_seconds, shape_efficiency
from meshlm.plan.hardware import Hardware
from meshlm.plan.step_time import attention_fraction

H100 = hardware("H100-SXM")
US = 1e-6


def by_hand(m: float, n: float, k: float, batch: float = 1.0) -> float:
    """The page's kernel formula with the H100 figures: 6 µs + max(FLOPs / 794.5 TFLOP/s, bytes / (0.8 · 3.35 TB/s))."""
    return 6 * US + max(2 * batch * m * n * k / 794.5e12, 2 * batch * (m * k + k * n + m * n) / (0.8 * 3.35e12))


# XLA's measured H100 bf16 rates (xla/service/gpu/model/matmul_interpolator_data.h, key sm_90), TFLOP/s:
# (batch, m, n, k) -> rate; a spread from launch-bound to compute-bound shapes.
XLA_SM90 = {
    (1, 256, 512, 256): 11.5,
    (1, 1024, 2048, 256): 139.5,
    (1, 4096, 512, 512): 238.8,
    (2, 1024, 2048, 1024): 493.4,
    (1, 2048, 2048, 2048): 632.0,
    (4, 1024, 2048, 2048): 712.7,
    (2, 4096, 4096, 2048): 763.0,
    (1, 4096, 4096, 4096): 783.3,
}


def test_kernel_model_reproduces_xla_h100_measurements():
    """The fixed time (6.0 µs, fitted to 72 of XLA's points at log-rms 9.5 %) and the MAMF rate reproduce the
    spread from 11 to 783 TFLOP/s: each point within 20 % (the fit's worst over these eight), log-rms under 10 %."""
    errors = []
    for (b, m, n, k), measured in XLA_SM90.items():
        predicted = 2 * b * m * n * k / gemm_seconds(m, n, k, H100, b) / 1e12
        assert predicted == pytest.approx(measured, rel=0.2), (b, m, n, k)
        errors.append(math.log(predicted / measured))
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.10


def test_large_small_and_skinny_kernels():
    """A large well-shaped GEMM runs at the MAMF rate (794.5 of 989 TFLOP/s on H100, within its 6 µs: 0.1 %);
    a tiny one costs the fixed time; a skinny one (16 rows) is bound by its weight's bytes."""
    big = 2 * 16384**3 / gemm_seconds(16384, 16384, 16384, H100)
    assert big == pytest.approx(794.5e12, rel=2e-3)
    assert gemm_seconds(64, 64, 64, H100) == pytest.approx(6 * US, rel=0.01)  # its 24 KiB: 9 ns
    skinny = gemm_seconds(16, 8192, 8192, H100)
    assert skinny == pytest.approx(6 * US + 2 * (16 * 8192 * 2 + 8192**2) / (0.8 * 3.35e12))


def test_megatron_layer_at_tp8_by_hand():
    """Llama 3 8B's layer on one of 8 tensor-parallel ranks, 2,048 tokens, Megatron's fused GEMMs: qkv (n =
    (4096 + 2·1024)/8), o (k = 4096/8), fc1 (n = 2·14336/8), fc2 (k = 14336/8). The efficiency is their FLOPs
    at 794.5 TFLOP/s over their summed kernel times; at tp = 1 the same layer runs ~0.99 of the large rate."""
    m = 2048
    shapes = [(m, 768, 4096), (m, 4096, 512), (m, 3584, 4096), (m, 4096, 1792)]
    flops = sum(2 * m * n * k for m, n, k in shapes)
    expected = flops / 794.5e12 / sum(by_hand(*s) for s in shapes)
    model = PRESETS["llama3-8b"]
    assert [(g[1], g[2], g[3]) for g in dense_gemms(model, m, 8, "megatron")] == shapes
    assert shape_efficiency(model, m, 8, 1, "megatron", H100)[0] == pytest.approx(expected)
    assert 0.85 < expected < 0.95
    assert shape_efficiency(model, 8192, 1, 1, "megatron", H100)[0] > 0.98


def test_expert_parallelism_feeds_the_experts_more_rows():
    """Qwen3-30B-A3B (128 experts of width 768, top-8, h 2048), 4,096 tokens a rank: at ep = 1 each expert
    gets 4096·8/128 = 256 rows; at ep = 8 eight ranks send to 16 local experts, 2,048 rows each. The grouped
    expert GEMMs (one kernel for the local experts) are then far from launch- and memory-bound."""
    model = PRESETS["qwen3-30b-a3b"]
    alone = shape_efficiency(model, 4096, 1, 1, "meshlm", H100)[0]
    spread = shape_efficiency(model, 4096, 1, 8, "meshlm", H100)[0]
    up, down = by_hand(256, 768, 2048, 128), by_hand(256, 2048, 768, 128)
    experts_alone = 3 * 2 * 128 * 256 * 768 * 2048 / 794.5e12 / (2 * up + down)
    assert experts_alone < 0.75  # 256-row experts: their weights' bytes bound them
    assert alone < 0.7 < 0.9 < spread


def test_step_prices_gemms_at_their_shape_rate():
    """The same step on an H100 with and without the published matmul_max (without it: the flat GEMM rate).
    Llama 3 8B at tp = 8 with 4,096-token micro-batches (its k and v projections 128 wide a rank, past the
    host's 16 ms of launches): its GEMMs run at ~0.8 of a large GEMM's rate, so its compute grows by more than
    a tenth; Llama 3 70B's 8K-token GEMMs at tp = 1 are large: within 1 %."""

    def flat(seq_len: int) -> Hardware:  # the same attention rate, which is a fraction of matmul_max
        fraction = attention_fraction(H100, "flash2", seq_len, 128)
        return dataclasses.replace(H100, matmul_max=None, attention_chip=None, attention_efficiency=fraction)

    small = Workload(PRESETS["llama3-8b"], seq_len=4096, global_batch=8, train_tokens=1e9)
    strategy = Candidate(Layout(tp=8), ParallelOptions(zero=0, sequence_parallel=True), micro_batch=1, recompute="none")
    shaped, plain = step_time(small, strategy, H100), step_time(small, strategy, flat(4096))
    assert plain.compute > 8 * 32 * H100.layer_overhead_s  # device-bound: not the host's launches
    assert shaped.compute > 1.1 * plain.compute
    large = Workload(PRESETS["llama3-70b"], seq_len=8192, global_batch=8, train_tokens=1e9)
    strategy = Candidate(Layout(dp=8), ParallelOptions(zero=3), micro_batch=1, recompute="full")
    plain_large = step_time(large, strategy, flat(8192)).compute
    assert step_time(large, strategy, H100).compute == pytest.approx(plain_large, rel=0.01)


def test_measured_rates_and_cpu_are_taken_as_they_are():
    """A calibration's measured matmul rate and the cpu's already are the rates the step runs at."""
    model = PRESETS["llama3-1b"]
    assert shape_efficiency(model, 512, 8, 1, "meshlm", hardware("cpu")) == (1.0, 1.0)
    measured = hardware("H100-SXM", {"device": "H100-SXM", "matmul_flops": 6e14})
    assert shape_efficiency(model, 512, 8, 1, "meshlm", measured) == (1.0, 1.0)
