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
# Where a rank's slice begins in the full tensor: (dim, offset), or one such pair per sliced dim (a stacked
# expert weight under expert and tensor parallelism: its experts along dim 0, its hidden units along another).
TensorSlice = tuple[int, int] | tuple[tuple[int, int], ...]


def slice_offsets(tp_slice: TensorSlice | None) -> tuple[tuple[int, int], ...]:
    """A TensorSlice as one (dim, offset) pair per sliced dim; () for the whole tensor."""
    if tp_slice is None:
        return ()
    return (tp_slice,) if isinstance(tp_slice[0], int) else tuple(tp_slice)


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
    tp_slice: TensorSlice | None = None,
    start: int = 0,
) -> torch.Tensor:
    """Write elements [start, start + out.numel()) of the flattened tensor `local_shape` into `out` (1-D, any
    dtype and device): the slice of parameter `name` (full shape `shape`) that begins at `tp_slice = (dim,
    offset)` (or at one such offset per sliced dim), or the whole parameter. A slice of dim 0 generates only
    its rows; a slice of another dim generates its rows whole and keeps its part of each."""
    if out.numel() == 0:
        return out
    if isinstance(rule, Constant):
        return out.fill_(rule.value)
    local_shape = tuple(shape if local_shape is None else local_shape)
    rows, cols = _as_matrix(shape)
    local_cols = _as_matrix(local_shape)[1]
    slices = slice_offsets(tp_slice)
    row0 = sum(offset for dim, offset in slices if dim == 0)
    inner = [(dim, offset) for dim, offset in slices if dim > 0]  # narrowed within each generated row
    if len(local_shape) != len(shape) or any(
        not 0 <= dim < len(shape) or offset + local_shape[dim] > shape[dim] for dim, offset in slices
    ):
        raise ValueError(f"{name}: slice {local_shape} at {tp_slice} is outside the parameter {tuple(shape)}")
    end = start + out.numel()
    per_block = max(1, BLOCK_ELEMENTS // cols)
    row, last = start // local_cols, (end - 1) // local_cols  # local rows touched
    while row <= last:
        block = (row + row0) // per_block
        first_row = block * per_block  # global
        block_rows = min(per_block, rows - first_row)
        tile = _normal_block(seed, name, block, block_rows, cols, rule.std)
        stop = min(last + 1, first_row + block_rows - row0)  # local rows this block covers: [row, stop)
        part = tile[row + row0 - first_row : stop + row0 - first_row]
        if inner:
            part = part.view(-1, *shape[1:])
            for dim, offset in inner:
                part = part.narrow(dim, offset, local_shape[dim])
        part = part.reshape(-1)
        lo, hi = max(start, row * local_cols), min(end, stop * local_cols)
        out[lo - start : hi - start].copy_(part[lo - row * local_cols : hi - row * local_cols])
        row = stop
    return out
