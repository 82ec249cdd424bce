"""One ring block of attention through scaled_dot_product_attention's fused kernels, with its log-sum-exp.

Ring attention (meshlm.parallel.cp.attention) attends this rank's queries to one K/V block at a time and
merges the blocks by log-sum-exp, so it needs what `F.scaled_dot_product_attention` computes but does not
return: each row's log-sum-exp. The aten ops behind it do return it, and their backward ops take the merged
output and log-sum-exp of the whole row (not the block's), which makes each block's gradients exact:

  cpu   `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`): a tiled flash kernel, every float dtype,
        grouped key/value heads taken as they are.
  cuda  `_scaled_dot_product_flash_attention` (fp16/bf16, grouped heads taken as they are) where
        `torch.backends.cuda.can_use_flash_attention` says so, else `_scaled_dot_product_efficient_attention`
        (fp32 too), whose key/value heads are broadcast to the query heads by an expanded view. Both are
        asked through `SDPAParams`, so `torch.nn.attention.sdpa_kernel` restricts them as it does SDPA.

No kernel here materialises a block's scores: a block costs the kernel's O(rows × head_dim) memory. `causal`
is the top-left causal mask of a square block (the ring's own, diagonal block); other blocks are unmasked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BlockKernel", "block_kernel"]


@dataclass
class BlockKernel:
    """The kernel one ring attention call runs its blocks through: `name` is the aten forward op's name.
    The CUDA ops hand back per-call state their backward needs (sequence offsets, dropout seeds), kept per
    block in `saved` in the order the forward ran the blocks."""

    name: str
    saved: list[tuple[Any, ...]] = field(default_factory=list)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (b, h, sq, d) in q's dtype, log-sum-exp (b, h, sq) fp32 or wider) of q against one block."""
        if self.name == "cpu_flash":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        if self.name == "flash":
            out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
            self.saved.append((rest[0], rest[1], rest[2], rest[3], rest[4], rest[5]))
            return out, lse
        k, v = _broadcast_heads(k, q.shape[1]), _broadcast_heads(v, q.shape[1])
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        self.saved.append((seed, offset))
        return out, lse[..., : q.shape[2]]  # the kernel pads the statistics to a multiple of 32 rows

    def backward(
        self,
        block: int,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of the forward's `block`-th call, given the merged output and log-sum-exp of the rows;
        dk and dv have k's heads."""
        lse = lse.contiguous()
        if self.name == "cpu_flash":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
            )
        if self.name == "flash":
            cq, ck, mq, mk, seed, offset = self.saved[block]
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
            )
        seed, offset = self.saved[block]
        kv_heads, wide_k, wide_v = k.shape[1], _broadcast_heads(k, q.shape[1]), _broadcast_heads(v, q.shape[1])
        padded = F.pad(lse, (0, -lse.shape[-1] % 32))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, wide_k, wide_v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


def block_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockKernel:
    """The fused kernel for these inputs: the CPU flash kernel; on CUDA flash where SDPA's own checks allow
    it with grouped heads and no mask, else the memory-efficient kernel. A one-line ValueError where neither
    runs these inputs (ring attention has no unfused fallback)."""
    if q.device.type == "cpu":
        return BlockKernel("cpu_flash")
    if q.device.type != "cuda":
        raise ValueError(f"ring attention: no fused SDPA kernel for device {q.device.type!r}; valid: cpu, cuda")
    gqa = q.shape[1] != k.shape[1]
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, gqa)
    if torch.backends.cuda.can_use_flash_attention(params):
        return BlockKernel("flash")
    wide = _broadcast_heads(k, q.shape[1])
    if torch.backends.cuda.can_use_efficient_attention(
        torch.backends.cuda.SDPAParams(q, wide, wide, None, 0.0, True, False)
    ):
        return BlockKernel("efficient")
    raise ValueError(
        f"ring attention: neither the flash nor the memory-efficient SDPA kernel takes {q.dtype} q {tuple(q.shape)}, "
        f"k {tuple(k.shape)} on this GPU; valid: head_dim a multiple of 8, fp16/bf16 (flash) or fp32 (efficient)"
    )


def _broadcast_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, heads, s, d) as an expanded view where kv_heads divides heads: each
    key/value head seen by its group of query heads. A view only where one stride can step through the
    groups (one key/value head: stride 0); otherwise a copy, which only the efficient kernel's GQA asks for."""
    b, kv_heads, s, d = x.shape
    if kv_heads == heads:
        return x
    return x[:, :, None].expand(b, kv_heads, heads // kv_heads, s, d).reshape(b, heads, s, d)


def _sum_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over broadcast key/value heads (b, h, s, d) summed back to (b, kv_heads, s, d)."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)
