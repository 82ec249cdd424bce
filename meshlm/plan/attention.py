"""Flash-attention kernel rates by sequence length and head dimension, from published measurements.

flash-attention's README (Dao-AILab/flash-attention, "Performance": assets/flash2_a100_fwd_bwd_benchmark.png
and assets/flash2_h100_fwd_bwd_benchmark.png) plots forward + backward TFLOP/s of each kernel on one A100
80GB SXM4 and one H100 80GB SXM5 at hidden size 2048 (16 or 32 heads), batch 16k / seqlen, for sequence
lengths 512 to 16k, head dimension 64 and 128, with and without a causal mask. The FLOPs are its
`benchmarks/benchmark_flash_attention.py` count (4·b·s²·h·d forward, halved when causal, backward 2.5×),
the count `step_time.CAUSAL_FLASH_WORK` converts to. Only the causal panels are entered: a causal LM's.

Kernels: `flash2` (FlashAttention-2: PyTorch SDPA's flash backend, Megatron, torchtitan), `flash1`
(FlashAttention 1.x), `triton` (flash-attention's `flash_attn_triton.py`, the kernel MPT's
`attn_impl: triton` runs). The triton kernel is measured on A100 only; on H100 it is priced at the H100's
FlashAttention-1 figure times its A100 ratio to FlashAttention-1 at the same shape (the kernel predates
Hopper-specific code, as FlashAttention-1 does; its header: "Overall Triton forward + backward is slightly
slower than CUDA forward + backward"; the A100 figure has it at 0.82-1.07× FlashAttention-1).
"""

from __future__ import annotations

import math
from typing import Literal

Kernel = Literal["flash2", "flash1", "triton"]
KERNELS: tuple[Kernel, ...] = ("flash2", "flash1", "triton")
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)

# (chip, kernel, head dim) -> causal forward + backward TFLOP/s at SEQ_LENS, read off the README's figures
# (panels (c) head dim 64 and (d) head dim 128).
CAUSAL_TFLOPS: dict[tuple[str, Kernel, int], tuple[float, ...]] = {
    ("A100", "flash2", 64): (88, 119, 140, 156, 165, 171),
    ("A100", "flash2", 128): (99, 133, 155, 173, 182, 189),
    ("A100", "flash1", 64): (58, 70, 77, 87, 92, 97),
    ("A100", "flash1", 128): (55, 62, 69, 76, 80, 83),
    ("A100", "triton", 64): (59, 75, 79, 76, 79, 80),
    ("A100", "triton", 128): (50, 61, 68, 74, 78, 80),
    ("H100", "flash2", 64): (141, 192, 232, 257, 273, 284),
    ("H100", "flash2", 128): (163, 221, 265, 294, 308, 328),
    ("H100", "flash1", 64): (104, 123, 136, 138, 149, 156),
    ("H100", "flash1", 128): (98, 109, 108, 126, 135, 137),
}


def _published_rates(chip: str, kernel: Kernel, head_dim: int) -> tuple[float, ...]:
    """The causal curve of one kernel at one of HEAD_DIMS; the triton kernel on a chip without its own
    measurement scaled from FlashAttention-1 by its A100 ratio, sequence length by sequence length."""
    if (chip, kernel, head_dim) in CAUSAL_TFLOPS:
        return CAUSAL_TFLOPS[chip, kernel, head_dim]
    flash1, ratio = CAUSAL_TFLOPS[chip, "flash1", head_dim], _triton_ratio(head_dim)
    return tuple(f * r for f, r in zip(flash1, ratio, strict=True))


def _triton_ratio(head_dim: int) -> tuple[float, ...]:
    triton, flash1 = CAUSAL_TFLOPS["A100", "triton", head_dim], CAUSAL_TFLOPS["A100", "flash1", head_dim]
    return tuple(t / f for t, f in zip(triton, flash1, strict=True))


def _along(points: tuple[float, ...], xs: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation of points over xs at x, held constant past either end."""
    if x <= xs[0]:
        return points[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return points[i - 1] + (points[i] - points[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return points[-1]


def kernel_flops(chip: str, kernel: Kernel, seq_len: float, head_dim: int) -> float:
    """Forward + backward FLOP/s of a causal flash kernel on `chip` ("A100" or "H100") at this sequence length
    and head dimension, in flash-attention's FLOP count: interpolated linearly in log2(sequence length)
    between the measured lengths and linearly in head dimension between 64 and 128, held at the nearest
    measurement outside them (a head of 80 between the two curves; 256 at 128's)."""
    x = math.log2(max(seq_len, 1.0))
    logs = tuple(math.log2(s) for s in SEQ_LENS)
    by_head = [_along(_published_rates(chip, kernel, d), logs, x) for d in HEAD_DIMS]
    return 1e12 * _along(tuple(by_head), tuple(float(d) for d in HEAD_DIMS), float(head_dim))
