"""Peak FLOP/s, the denominator of MFU: a datasheet table for GPUs, a measured matmul rate elsewhere.

torch is imported by the functions that measure: the planner reads the table and the labels without it."""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity). Matched in order against the CUDA
# device name, so the more specific names come first.
GPU_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_peak_flops(name: str) -> float | None:
    """Datasheet peak of a GPU by its CUDA name ('NVIDIA H100 80GB HBM3'), None if not in the table."""
    return next((peak for key, peak in GPU_PEAK_FLOPS if key.lower() in name.lower()), None)


def matmul_flops(
    n: int = 512,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seconds: float = 0.2,
    slow_factor: float = 1.0,
) -> float:
    """Achieved FLOP/s of repeated n×n matmuls for about `seconds`.

    `slow_factor` > 1 sleeps inside the timed region so the rank looks that many times slower (to test
    straggler and outlier detection). dtype defaults to float32."""
    import torch

    device = torch.device(device)
    dtype = dtype or torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm-up: allocation, kernel selection
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            torch.mm(a, b)
        iters += 4
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    if slow_factor > 1:
        time.sleep(elapsed * (slow_factor - 1))
        elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed


def copy_bandwidth(nbytes: int, device: torch.device | str = "cpu", seconds: float = 0.2) -> float:
    """Memory bandwidth in bytes/s from repeated copies of an `nbytes` buffer (each reads and writes it)."""
    import torch

    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    iters, start = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * nbytes * iters / elapsed


@functools.cache
def measured_peak_flops(device_type: str = "cpu") -> float:
    """This process's fp32 matmul rate on CPU (bf16 on an unknown GPU), measured once and cached.

    Ranks sharing a machine should measure at the same time (right after a barrier) so each sees its share."""
    import torch

    if device_type == "cuda":
        return matmul_flops(4096, torch.bfloat16, "cuda", seconds=0.5)
    return matmul_flops(512, torch.float32, "cpu", seconds=0.3)


def peak_flops(device: torch.device) -> float:
    """Per-device peak for MFU: the GPU table, else a measured matmul rate."""
    import torch

    if device.type == "cuda":
        table = gpu_peak_flops(torch.cuda.get_device_name(device))
        if table is not None:
            return table
    return measured_peak_flops(device.type)


# What an MFU figure is a fraction of, as every MFU label says it: "MFU 41.0% of datasheet peak".
DATASHEET_PEAK = "datasheet peak"
MEASURED_MATMUL = "measured matmul"
GIVEN_PEAK = "log.peak_flops"


def mfu_basis(device_type: str, device_name: str = "", given: bool = False) -> str:
    """The denominator `peak_flops` picks for this device: a CPU or an unknown GPU has no datasheet peak,
    so its MFU is a fraction of its own measured matmul rate (near 100% is possible there)."""
    if given:
        return GIVEN_PEAK
    if device_type == "cuda" and gpu_peak_flops(device_name) is not None:
        return DATASHEET_PEAK
    return MEASURED_MATMUL
