"""Ring attention runs on scaled_dot_product_attention's fused kernels, with the ring's hops overlapped.

What ran is read from the profiler's aten op names over a forward and backward of ring attention at cp=2
(grouped heads, fp32): the CPU flash kernel and its backward once per visible block, and no matmul at all —
the score blocks of the previous implementation (matmul of q by kᵀ, softmax, matmul by v) and its
`repeat_interleave` of the key/value heads both show up as aten ops the test forbids. Mutation: with the
pre-#51 attention.py (materialised fp32 score matmuls) the test fails on both counts. The order of events
shows each hop posted before the block it overlaps is computed and waited after it; mutation: waiting on
the hop right after posting it (the old `ring_shift`, blocking) fails the order check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from torch.profiler import ProfilerActivity, profile

from meshlm.parallel.cp import attention as cpm
from meshlm.parallel.cp import kernels

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
# Any of these on the path means scores materialised by matmuls, or key/value heads copied for GQA
FORBIDDEN = ("aten::matmul", "aten::bmm", "aten::mm", "aten::baddbmm", "aten::repeat_interleave", "aten::softmax")


def _ring_ops() -> dict[str, int]:
    """aten op counts of one ring attention forward + backward on this rank's chunks."""
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, generator=g, requires_grad=True) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpm.ring_attention(q, k, v, dist.group.WORLD).sum().backward()
    return {e.key: e.count for e in prof.key_averages()}


def _events() -> list[str]:
    """The order of hop posts, hop waits and block kernels in one forward + backward on this rank."""
    log: list[str] = []
    post, forward, backward = cpm.ring_shift, kernels.BlockKernel.forward, kernels.BlockKernel.backward

    class Logged:
        def __init__(self, hop: cpm.RingHop) -> None:
            self.hop = hop

        def wait(self) -> torch.Tensor:
            log.append("wait")
            return self.hop.wait()

    def logged_post(tensor: torch.Tensor, group: dist.ProcessGroup) -> Logged:
        log.append("post")
        return Logged(post(tensor, group))

    def logged_forward(self, *args):
        log.append("kernel")
        return forward(self, *args)

    def logged_backward(self, *args):
        log.append("kernel")
        return backward(self, *args)

    cpm.ring_shift, kernels.BlockKernel.forward, kernels.BlockKernel.backward = (
        logged_post,
        logged_forward,
        logged_backward,
    )
    try:
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        out = cpm.ring_attention(q, k, v, dist.group.WORLD)
        log.append("|")
        out.sum().backward()
    finally:
        cpm.ring_shift, kernels.BlockKernel.forward, kernels.BlockKernel.backward = post, forward, backward
    return log


def test_ring_runs_the_flash_kernel() -> None:
    for ops in run_shared(_ring_ops, 2):
        # cp=2: each rank has two visible blocks (its own, causal, and half of the other), each through the
        # flash kernel once forward and once backward
        assert ops.get(FLASH) == 2 and ops.get(FLASH + "_backward") == 2, ops
        assert not [name for name in FORBIDDEN if name in ops], ops


def test_ring_posts_each_hop_before_the_block_it_overlaps() -> None:
    for log in run_shared(_events, 2):
        # forward: the hop of the own block is posted before its kernel and waited after it; the second
        # block needs no hop. Backward: the K/V hop is posted before the kernel; each gradient hop is posted
        # after the block's kernel and waited after the next block's kernel; the last one brings it home.
        forward, backward = " ".join(log).split(" | ")
        assert forward == "post kernel wait kernel", log
        assert backward == "post kernel post wait kernel wait post wait", log


def test_block_plan_refuses_a_mask_the_kernels_cannot_run() -> None:
    # positions not increasing inside a rank: the own block's mask is not the kernels' top-left triangle
    with pytest.raises(ValueError, match="not top-left triangular"):
        cpm._block_plan(torch.tensor([1, 0]), torch.tensor([1, 0]))


def test_block_kernel_refuses_a_device_without_fused_kernels() -> None:
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match="no fused SDPA kernel for device 'meta'"):
        kernels.block_kernel(q, q, q)
    assert kernels.block_kernel(*(torch.empty(1, 2, 4, 8) for _ in range(3))).name == "cpu_flash"


def test_broadcast_heads_is_a_view_for_one_kv_head_and_sums_back() -> None:
    k = torch.randn(2, 1, 4, 8)
    wide = kernels._broadcast_heads(k, 4)
    assert wide.shape == (2, 4, 4, 8) and wide.data_ptr() == k.data_ptr() and wide.stride(1) == 0
    grouped = torch.randn(2, 2, 4, 8)
    assert torch.equal(kernels._broadcast_heads(grouped, 4)[:, 3], grouped[:, 1])
    assert torch.equal(kernels._sum_heads(kernels._broadcast_heads(grouped, 4), 2), 2 * grouped)
