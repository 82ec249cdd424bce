"""Layout-free parameter initialisation: every element is a function of (seed, parameter name, global index).

A parameter is seen as a matrix (its first dimension by the product of the others) and generated in fixed
blocks of whole rows, block b from its own generator seeded by hash(seed, name, b). Any rank can therefore
produce exactly the elements it owns — a tensor-parallel row or column slice, a ZeRO flat range, or both —
without producing the rest (a column slice generates its rows whole and keeps its columns: compute, not
memory), and every layout, the single-process model included, starts from bit-identical weights. Values are
drawn in fp32 on the CPU and cast on the copy into the destination, so the device and the working dtype do
not change them either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Elements per generated block (rows are never split: a block holds max(1, BLOCK // row width) rows).
# 64 Ki fp32 values = 256 KiB: the most a fill ever holds beyond its destination.
BLOCK_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Normal:
    """N(0, std²) per element."""

    std: float


@dataclass(frozen=True)
class Constant:
    """Every element `value` (norm weights: 1; biases: 0)."""

    value: float


InitRule = Normal | Constant


def block_seed(seed: int, name: str, block: int) -> int:
    """A stable 63-bit seed for one block (Python's hash() is salted per process, so not that)."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _as_matrix(shape: Sequence[int]) -> tuple[int, int]:
    rows = shape[0] if len(shape) else 1
    return rows, math.prod(shape[1:]) if len(shape) > 1 else 1


def _normal_block(seed: int, name: str, block: int, rows: int, cols: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(block_seed(seed, name, block))
    return torch.randn(rows, cols, generator=g).mul_(std)


@torch.no_grad()
def fill_(
    out: torch.Tensor,
    rule: InitRule,
    seed: int,
    name: str,
    shape: Sequence[int],
    local_shape: Sequence[int] | None = None,
    tp_slice: tuple[int, int] | None = None,
    start: int = 0,
) -> torch.Tensor:
    """Write elements [start, start + out.numel()) of the flattened tensor `local_shape` into `out` (1-D, any
    dtype and device): the slice of parameter `name` (full shape `shape`) that begins at `tp_slice = (dim,
    offset)` (dim 0 or, for matrices, 1), or the whole parameter."""
    if out.numel() == 0:
        return out
    if isinstance(rule, Constant):
        return out.fill_(rule.value)
    rows, cols = _as_matrix(shape)
    local_rows, local_cols = _as_matrix(shape if local_shape is None else local_shape)
    row0 = col0 = 0
    if tp_slice is not None:
        dim, offset = tp_slice
        if dim == 0:
            row0 = offset
        elif dim == 1 and len(shape) == 2:
            col0 = offset
        else:
            raise ValueError(f"{name}: element init slices dim 0, or dim 1 of a matrix; got dim {dim} of {shape}")
    if row0 + local_rows > rows or col0 + local_cols > cols:
        raise ValueError(f"{name}: slice {tuple(local_shape)} at {tp_slice} is outside the parameter {tuple(shape)}")
    end = start + out.numel()
    per_block = max(1, BLOCK_ELEMENTS // cols)
    row, last = start // local_cols, (end - 1) // local_cols  # local rows touched
    while row <= last:
        block = (row + row0) // per_block
        first_row = block * per_block  # global
        block_rows = min(per_block, rows - first_row)
        tile = _normal_block(seed, name, block, block_rows, cols, rule.std)
        stop = min(last + 1, first_row + block_rows - row0)  # local rows this block covers: [row, stop)
        part = tile[row + row0 - first_row : stop + row0 - first_row, col0 : col0 + local_cols].reshape(-1)
        lo, hi = max(start, row * local_cols), min(end, stop * local_cols)
        out[lo - start : hi - start].copy_(part[lo - row * local_cols : hi - row * local_cols])
        row = stop
    return out
