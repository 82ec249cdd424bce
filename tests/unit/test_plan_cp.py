"""The planner's context-parallel terms against what meshlm.parallel.cp.attention runs, from first principles.

Memory: ring attention's working set is counted tensor by tensor from the shapes the backward loop allocates
(the K/V block in hand and in flight, the gradient accumulator in hand and in flight, the fp32 query-gradient
accumulator, one block's kernel gradients) and no score block anywhere; under cp no s² probabilities are
stored even where the model's own attention is assumed unfused. Time: the ring's exposed communication is
re-derived by simulating the ring's loop (the order tests/parallel/test_cp_kernels.py asserts: each hop
posted before the kernel it overlaps, waited after it) with one link that carries transfers in the order
posted, and compared with `cp_layer_time`'s closed form over a range of kernel times.

Mutations: dropping `ring_buffer` from `memory` fails the buffers test; pricing every hop exposed again
(core_s ignored in cp_layer_time) fails the simulation test; cp_attention_factor's (cp + 1)/cp restored
fails the equal-compute assertion.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.model import preset
from meshlm.parallel.mesh import Layout
from meshlm.plan.exchanges import FLASH_FORWARD_SHARE, cp_layer_time
from meshlm.plan.hardware import hardware
from meshlm.plan.memory import (
    DEFAULTS,
    Assumptions,
    Candidate,
    Workload,
    layer_activation_bytes,
    memory,
    memory_key,
    ring_buffer,
)
from meshlm.plan.network import collective_time
from meshlm.plan.step_time import ring_core_time, step_time

MODEL = preset("llama3-8b")  # 32 query heads, 8 key/value heads of 128
BF16, FP32 = 2, 4


def _numel(*shape: int) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_ring_buffer_counts_the_backward_loops_tensors() -> None:
    w = Workload(MODEL, 8192, 16, 1e9, precision="bf16")
    ring = Candidate(Layout(cp=4, dp=2), micro_batch=1)
    b, t, d, h, kvh = 1, 8192 // 4, MODEL.head_dim, MODEL.n_heads, MODEL.n_kv_heads
    kv_block = _numel(2, b, kvh, t, d)  # torch.stack([k, v])
    tensors = [
        (kv_block, BF16),  # the K/V block in hand
        (kv_block, BF16),  # the next one, in flight (RingHop.received)
        (kv_block, FP32),  # the K/V-gradient accumulator in hand
        (kv_block, FP32),  # the previous one, in flight
        (_numel(b, h, t, d), FP32),  # dq accumulator
        (_numel(b, h, t, d), BF16),  # one block's dq from the kernel (the own block: all rows)
        (_numel(b, kvh, t, d), BF16),  # its dk
        (_numel(b, kvh, t, d), BF16),  # its dv
    ]
    assert ring_buffer(w, ring) == sum(n * size for n, size in tensors)
    # the old implementation's working set held several fp32 score-sized blocks (all heads, t × t/2: scores,
    # probabilities and their gradients); the kernels keep none, and the whole working set is below one
    assert ring_buffer(w, ring) < _numel(b, h, t, t // 2) * FP32
    hw = hardware("h100")
    ulysses = ring.with_options(cp_attention="ulysses")
    assert memory(w, ring, hw).buffers - memory(w, ulysses, hw).buffers == ring_buffer(w, ring)
    assert memory_key(ulysses) == ulysses  # the search no longer shares ring's memory with Ulysses
    assert ring_buffer(w, Candidate(Layout(dp=8))) == 0.0 and ring_buffer(w, ulysses) == 0.0


def test_cp_stores_no_probabilities_even_for_an_unfused_model_attention() -> None:
    args = (MODEL, 8192, 1, 1, False, "none", "bf16")
    assert layer_activation_bytes(*args, False, "meshlm", 4) == layer_activation_bytes(*args, True, "meshlm", 4)
    assert layer_activation_bytes(*args, False, "meshlm", 1) > layer_activation_bytes(*args, True, "meshlm", 1)
    w = Workload(MODEL, 8192, 16, 1e9)
    ring, hw = Candidate(Layout(cp=4, dp=2), micro_batch=1), hardware("h100")
    unfused = Assumptions(flash_attention=False)
    assert step_time(w, ring, hw, unfused).compute == pytest.approx(step_time(w, ring, hw).compute)


def _simulated_ring(cp: int, hop: float, grad_hop: float, fwd: float, bwd: float, forwards: int) -> float:
    """Exposed seconds of one layer's ring, walking _RingAttention's loops: one compute stream (kernels),
    one link carrying transfers one after another in the order posted; a wait blocks compute until its
    transfer is done. Returns the elapsed time less the kernels' time."""
    clock = link = 0.0

    def post(seconds: float) -> float:
        nonlocal link
        link = max(link, clock) + seconds
        return link  # when it arrives

    def wait(done: float) -> None:
        nonlocal clock
        clock = max(clock, done)

    kernels = 0.0
    for _ in range(forwards):  # forward (twice under full recompute)
        for step in range(cp):
            hop_done = post(hop) if step < cp - 1 else None
            clock, kernels = clock + fwd, kernels + fwd
            if hop_done is not None:
                wait(hop_done)
    grad_done = None
    for step in range(cp):  # backward
        hop_done = post(hop) if step < cp - 1 else None
        clock, kernels = clock + bwd, kernels + bwd
        if grad_done is not None:
            wait(grad_done)
        grad_done = post(grad_hop)
        if hop_done is not None:
            wait(hop_done)
    wait(grad_done)
    return clock - kernels


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ring_exposed_communication_matches_a_simulation_of_its_loop(cp: int, recompute: str) -> None:
    hw = hardware("h100")
    s = Candidate(Layout(cp=cp), micro_batch=1, recompute=recompute)
    tokens = 4096
    kv = MODEL.n_kv_heads * MODEL.head_dim
    link = hw.link("cp", False, "send_recv")
    hop = collective_time("send_recv", 2 * tokens * kv * BF16, 2, link)
    grad_hop = collective_time("send_recv", 2 * tokens * kv * FP32, 2, link)
    forwards = 2 if recompute == "full" else 1
    # kernel times from none (all exposed) to far longer than any hop (only the gradient's hop home exposed)
    for core in (0.0, 0.3 * hop * cp, 2 * hop * cp, 5 * (hop + grad_hop) * cp, 100 * grad_hop * cp):
        fwd, bwd = core / cp * FLASH_FORWARD_SHARE, core / cp * (1 - FLASH_FORWARD_SHARE)
        want = _simulated_ring(cp, hop, grad_hop, fwd, bwd, forwards)
        assert cp_layer_time(MODEL, tokens, s, hw, BF16, core) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert cp_layer_time(MODEL, tokens, s, hw, BF16, 1e3) == pytest.approx(grad_hop)


def test_ring_overlap_in_the_step_and_equal_compute_with_ulysses() -> None:
    w = Workload(MODEL, 32768, 8, 1e9)
    hw = hardware("h100")
    ring = Candidate(Layout(cp=8), micro_batch=1)
    core = ring_core_time(w, ring, hw, DEFAULTS)
    assert core > 0  # a GPU overlaps; a shared CPU node does not (gloo competes for the cores)
    assert ring_core_time(w, ring, hardware("cpu"), DEFAULTS) == 0.0
    t = step_time(w, ring, hw)
    blocking = cp_layer_time(MODEL, 32768 / 8, ring, hw, BF16)
    assert t.cp_comm < ring.micro_batches(w.global_batch) * MODEL.n_layers * blocking
    # causal kernel on the own block, the visible halves unmasked: the causal FLOPs, as Ulysses' SDPA. The
    # ring's kernels see seq/cp-long blocks, which flash runs at its shorter-sequence rate (meshlm.plan.attention):
    # slower than Ulysses' whole-sequence call; at one rate for every length the two are the same FLOPs.
    ulysses = ring.with_options(cp_attention="ulysses")
    assert t.compute > step_time(w, ulysses, hw).compute
    flat = dataclasses.replace(hw, attention_chip=None)  # no published rates by length: one flash rate
    assert step_time(w, ring, flat).compute == pytest.approx(step_time(w, ulysses, flat).compute)
