"""Flash-attention rates by sequence length (meshlm.plan.attention), against the published figures they are
read from (flash-attention's README, assets/flash2_{a100,h100}_fwd_bwd_benchmark.png, causal panels)."""

from __future__ import annotations

import pytest

from meshlm.model.config import preset
from meshlm.plan.attention import CAUSAL_TFLOPS, kernel_flops
from meshlm.plan.hardware import hardware
from meshlm.plan.memory import Assumptions, Workload
from meshlm.plan.search import Constraints, search
from meshlm.plan.step_time import attention_fraction


def test_measured_points_are_returned_as_published():
    """At a measured length and head dimension the rate is the figure's bar, e.g. FlashAttention-2 on H100
    at 2k, head 128, causal: 265 TFLOP/s; on A100 155; the triton kernel on A100 68. Fails if the
    interpolation is off by one length (2k reading 1k's 221 or 4k's 294)."""
    assert kernel_flops("H100", "flash2", 2048, 128) == pytest.approx(265e12)
    assert kernel_flops("A100", "flash2", 2048, 128) == pytest.approx(155e12)
    assert kernel_flops("A100", "triton", 2048, 128) == pytest.approx(68e12)
    assert kernel_flops("H100", "flash2", 512, 64) == pytest.approx(141e12)


def test_between_and_beyond_the_measurements():
    """Linear in log2(length) between measured lengths (3k is 0.585 of the way from 2k to 4k), linear in
    head dimension between 64 and 128 (96 is the mean), and held at the end points (64k reads 16k's 328, a
    head of 256 reads 128's): no extrapolation past what was measured."""
    at_3k = 265 + (294 - 265) * 0.5849625007211562
    assert kernel_flops("H100", "flash2", 3072, 128) == pytest.approx(at_3k * 1e12)
    assert kernel_flops("H100", "flash2", 2048, 96) == pytest.approx((232 + 265) / 2 * 1e12)
    assert kernel_flops("H100", "flash2", 65536, 128) == pytest.approx(328e12)
    assert kernel_flops("H100", "flash2", 2048, 256) == pytest.approx(265e12)
    assert kernel_flops("H100", "flash2", 128, 128) == pytest.approx(163e12)


def test_triton_on_h100_is_flash1_times_its_a100_ratio():
    """The triton kernel has no H100 measurement: FlashAttention-1's H100 bar times triton / FlashAttention-1
    on A100 at the same length and head (2k, 128: 108 × 68/69). Fails if it took FlashAttention-2's bar or
    the A100 figure unscaled."""
    assert ("H100", "triton", 128) not in CAUSAL_TFLOPS
    assert kernel_flops("H100", "triton", 2048, 128) == pytest.approx(108 * 68 / 69 * 1e12)


def test_rate_rises_with_sequence_length_and_prices_the_step():
    """FlashAttention-2's rate rises with the sequence (the figure: 163 → 328 TFLOP/s from 512 to 16k on
    H100), so the same attention FLOPs take longer at short sequences; the fraction is the kernel's rate over
    MAMF. A device without published figures keeps its attention_efficiency."""
    h100 = hardware("H100-SXM")
    short, long = (attention_fraction(h100, "flash2", s, 128) for s in (512, 16384))
    assert short == pytest.approx(163 / 794.5) and long == pytest.approx(328 / 794.5)
    assert attention_fraction(hardware("H200"), "flash2", 2048, 128) == attention_fraction(h100, "flash2", 2048, 128)
    assert attention_fraction(hardware("cpu"), "flash2", 2048, 128) == hardware("cpu").attention_efficiency


def test_slower_kernel_lowers_the_predicted_throughput():
    """The same published layout priced with the triton kernel (MPT's attn_impl) runs slower than with
    FlashAttention-2, and only its attention differs: the step's GEMM and communication parts are equal.
    Fails if --attention-kernel does not reach the step."""
    model = preset("llama3-8b")
    w = Workload(model, 2048, 64, 1e9, "bf16")
    c = Constraints(tp=1, pp=1, cp=1, zero=3, micro_batch=2, recompute="none")
    runs = {}
    for kernel in ("flash2", "triton"):
        a = Assumptions(runtime="megatron", attention_kernel=kernel)
        runs[kernel] = search(w, 8, hardware("H100-SXM"), constraints=c, a=a).plans[0].step
    assert runs["triton"].compute > runs["flash2"].compute
    assert runs["triton"].dp_comm == runs["flash2"].dp_comm
