"""FP8 training of the blocks' Linear layers (`train.fp8`): tensorwise dynamic scaling, as in torchao's float8
recipe and Transformer Engine's "current scaling".

Each matmul of a swapped layer quantises its two operands just before use: the activation and the weight to
float8 e4m3 in forward (more mantissa), the output gradient to e5m2 in backward (more range). A tensor's scale
is `FP8_MAX / amax` of that tensor, now (dynamic: no history to checkpoint), so its largest element lands on the
format's largest finite value; values are saturated to ±max, never inf. `torch._scaled_mm` multiplies the fp8
operands with fp32 accumulation and applies the inverse scales: forward y = x·wᵀ, backward dx = dy·w and
dw = dyᵀ·x, each with the operands' own scales, the gradients returned in the parameters' dtype.

The swap is a module swap after parallelization: plain `nn.Linear` modules of the plan's blocks become
`Float8Linear` (same parameters, so ZeRO's flat buffers and hooks stay), tensor-parallel Column/Row linears
keep their sharding and collectives and only their local matmul turns fp8 (each rank scales its own shard).
The embedding, the output head and the norms stay in the working dtype. Needs compute capability ≥ 8.9
(Ada, Hopper and later); anywhere else `check_fp8_device` refuses it in one line. `emulate=True` runs the same
quantisation with an fp32 matmul of the dequantised operands (what the CPU tests check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshlm.errors import InputError

if TYPE_CHECKING:
    from meshlm.parallel.parallel_plan import ParallelPlan

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (its quantised values are zero anyway)


class FP8Unsupported(InputError):
    """FP8 asked for on a device without FP8 matmuls."""


def check_fp8_device(device: torch.device) -> None:
    """One line unless `device` multiplies float8 (CUDA compute capability ≥ 8.9)."""
    if device.type != "cuda":
        raise FP8Unsupported(f"train.fp8 needs a GPU with FP8 matmuls (Ada, Hopper or later); this run is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise FP8Unsupported(
            f"train.fp8 needs FP8 matmuls (compute capability ≥ 8.9: Ada, Hopper or later); {name} is {major}.{minor}"
        )


def scale_for(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scale that maps amax(|t|) onto the format's largest finite value (tensorwise, on the device)."""
    amax = t.detach().abs().amax().float().clamp(min=EPS)
    return torch.finfo(dtype).max / amax


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t·scale saturated to ±max, in `dtype`; 1/scale, the dequantisation factor _scaled_mm takes)."""
    scale = scale_for(t, dtype)
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def dequantize(q: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    return q.float() * inverse_scale


def scaled_mm(
    a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype, emulate: bool
) -> torch.Tensor:
    """(a·a_inv) @ (b·b_inv) for fp8 a (row-major) and b, accumulated in fp32, returned in `out_dtype`."""
    if emulate:
        return (dequantize(a, a_inv) @ dequantize(b, b_inv)).to(out_dtype)
    # _scaled_mm wants its second operand column-major: b.t().contiguous().t() is b laid out so.
    return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """y = x·wᵀ with fp8 operands (e4m3), dx and dw from an e5m2 output gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_inv = quantize(rows, E4M3)
        w8, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.shapes = (x.shape, x.dtype, weight.dtype)
        ctx.emulate = emulate
        y = scaled_mm(x8, x_inv, w8.t(), w_inv, out_dtype, emulate)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_shape, x_dtype, w_dtype = ctx.shapes
        g8, g_inv = quantize(grad_out.reshape(-1, grad_out.shape[-1]), E5M2)
        grad_x = scaled_mm(g8, g_inv, w8, w_inv, x_dtype, ctx.emulate).view(x_shape)
        grad_w = scaled_mm(g8.t().contiguous(), g_inv, x8, x_inv, w_dtype, ctx.emulate)
        return grad_x, grad_w, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, emulate: bool = False):
    """F.linear with fp8 matmuls; the output (and x's gradient) in the autocast dtype if on, else x's dtype."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        y = _Float8Matmul.apply(x.to(out_dtype), weight, out_dtype, emulate)
        return y if bias is None else y + bias.to(out_dtype)


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in fp8 (its class swapped in place: the parameters stay where they are)."""

    fp8_emulate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_emulate)


class EmulatedFloat8Linear(Float8Linear):
    """A Float8Linear whose fp8 matmul is emulated (fp8 rounding, fp32 matmul): for devices without fp8."""

    fp8_emulate = True


def fp8_capable(module: nn.Module) -> bool:
    """_scaled_mm needs both matrix dimensions of the (local) weight to be multiples of 16."""
    weight = getattr(module, "weight", None)
    return weight is not None and weight.ndim == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def swap_to_fp8(blocks: list[nn.Module], emulate: bool = False) -> list[str]:
    """Make every Linear of `blocks` (plain or tensor-parallel) multiply in fp8; returns the swapped names.
    A layer whose local weight has a dimension that is not a multiple of 16 is left as it is."""
    from meshlm.parallel.tp.sharding import ColumnParallelLinear, RowParallelLinear

    swapped = []
    for i, block in enumerate(blocks):
        for name, module in block.named_modules():
            if not fp8_capable(module):
                continue
            if type(module) is nn.Linear:
                module.__class__ = EmulatedFloat8Linear if emulate else Float8Linear
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.linear = lambda x, w, b=None: fp8_linear(x, w, b, emulate)
            else:
                continue
            swapped.append(f"{i}.{name}")
    return swapped


def apply_fp8(chunks: list[nn.Module], plan: ParallelPlan, emulate: bool = False) -> list[str]:
    """Swap the Linear layers of every block of this rank's model chunks (the plan's pipeline layers) to fp8,
    after parallelization and before compilation; returns the swapped names. Refused in one line for a plan
    that names no layers and under sequence parallelism (its column-parallel matmul saves only a sequence
    shard, in the working dtype)."""
    layers = plan.pipeline.layers if plan.pipeline is not None else None
    if not layers:
        raise FP8Unsupported(f"train.fp8: the parallel plan {plan.name!r} names no transformer blocks")
    blocks = []
    for chunk in chunks:
        container = chunk.get_submodule(layers)
        blocks += list(container.values() if isinstance(container, nn.ModuleDict) else container)
    if any(getattr(getattr(m, "tp", None), "sequence_parallel", False) for b in blocks for m in b.modules()):
        raise FP8Unsupported("train.fp8 does not combine with parallel.sequence_parallel yet; turn one off")
    return swap_to_fp8(blocks, emulate)
