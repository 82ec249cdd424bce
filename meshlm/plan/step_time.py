"""Time of one optimizer step for one layout: compute at an achievable rate plus fixed host time per
micro-batch, α–β collectives over the link each mesh dim crosses, the pipeline bubble, exposed data-parallel
communication, and the optimizer. On a shared node (cpu) ranks time-share the cores.

Formulas and sources: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from meshlm.model.config import ModelConfig
from meshlm.model.flops import flops_per_token
from meshlm.plan.hardware import Hardware, Link
from meshlm.plan.memory import (
    BYTES,
    DEFAULTS,
    Assumptions,
    Layout,
    Workload,
    model_state_bytes,
    representative_stages,
    stage_layers,
    stage_params,
)

PEAK_EFFICIENCY = 0.5  # achievable fraction of datasheet peak for a whole training step's compute
MEASURED_EFFICIENCY = 0.8  # achievable fraction of a measured large-matmul rate
DP_OVERLAP = 0.8  # NCCL runs on a few SMs beside compute; gloo on cpu competes for the same cores


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Ring collectives over n ranks in the α–β model; nbytes is the full buffer (nccl-tests convention)."""
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / link.beta + 2 * (n - 1) * link.alpha
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / link.beta + (n - 1) * link.alpha
    if op == "send_recv":
        return nbytes / link.beta + link.alpha
    raise ValueError(f"unknown collective {op!r}")


def crosses_nodes(layout: Layout, dim: str, gpus_per_node: int) -> bool:
    """Whether some group of mesh dim `dim` spans two nodes. Ranks are numbered pp outermost, then dp,
    tp innermost (rank = (i_pp·dp + i_dp)·tp + i_tp) and fill nodes in order."""
    size = getattr(layout, dim)
    stride = {"tp": 1, "dp": layout.tp, "pp": layout.tp * layout.dp}[dim]
    span = (size - 1) * stride
    for block in range(0, layout.gpus, stride * size)[:gpus_per_node]:
        for first in range(block, block + min(stride, gpus_per_node)):
            if first // gpus_per_node != (first + span) // gpus_per_node:
                return True
    return False


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved
    (Narayanan et al. 2021)."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


@lru_cache(maxsize=1024)
def _flops_split(model: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of one layer and of the head, and forward attention-core FLOPs of one
    layer, all read off `flops_per_token` by differencing model sizes and sequence lengths."""
    one, two = (flops_per_token(model.replace(n_layers=n), seq_len) for n in (1, 2))
    forward = flops_per_token(model, seq_len, training=False)
    attention = (forward - flops_per_token(model, 0, training=False)) / model.n_layers
    return two - one, 2 * one - two, attention


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by part, and the throughput they imply."""

    compute: float
    tp_comm: float  # exposed tensor-parallel collectives
    pp_comm: float  # pipeline send/recv
    dp_comm: float  # exposed data-parallel / ZeRO collectives
    bubble: float
    optimizer: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recomputation), the MFU numerator
    mfu: float
    train_days: float

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble + self.optimizer

    def parts(self) -> dict[str, float]:
        names = ("compute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "total")
        return {name: getattr(self, name) for name in names}


def compute_rate(hw: Hardware, a: Assumptions) -> float:
    """Achievable FLOP/s of a training step on one device."""
    if hw.matmul_flops is not None:
        return hw.matmul_flops * (a.compute_efficiency or MEASURED_EFFICIENCY)
    return hw.peak_flops * (a.compute_efficiency or PEAK_EFFICIENCY)


def time_share(hw: Hardware, busy: float) -> float:
    """How many times slower than alone a single-threaded rank runs while `busy` ranks compute: on a shared
    node max(1, busy / cores), the cores being time-shared; 1 where every rank owns its device."""
    return max(1.0, busy / hw.cores) if hw.shared_node else 1.0


def micro_batch_time(flops: float, layers: int, hw: Hardware, a: Assumptions, busy: float) -> float:
    """One micro-batch's forward + backward on one rank: `flops` at the achievable rate of a rank alone,
    plus the size-independent host time (layers·layer_overhead + micro_batch_overhead). On a shared node the
    same thread does both, so they add, and time-sharing stretches both; on a GPU kernels run asynchronously
    behind the host, so the larger of the two counts."""
    work = flops / compute_rate(hw.per_rank(1), a)
    host = layers * hw.layer_overhead_s + hw.micro_batch_overhead_s
    if hw.shared_node:
        return (work + host) * time_share(hw, busy)
    return max(work, host)


def _dp_exposed(
    w: Workload, lay: Layout, hw: Hardware, a: Assumptions, psi: float, layers: int, compute_mb: float
) -> float:
    """Data-parallel communication left on the critical path. Gradients are reduced in buckets that hide
    behind backward (a.dp_overlap of it) except the last; ZeRO-1/2 all-gather updated weights after the
    step; ZeRO-2 reduce-scatters every micro-batch (sharded gradients cannot accumulate); ZeRO-3 gathers
    and reduces layer by layer, in forward, backward (and the recompute forward), prefetched except the
    first and last. Every bucket or layer is its own collective and pays the latency term again."""
    if lay.dp == 1:
        return 0.0
    w_bytes, g_bytes, _, _ = BYTES[w.precision]
    cross = crosses_nodes(lay, "dp", hw.gpus_per_node)
    bucket = a.bucket_mb * 1e6

    def t(op: str, nbytes: float, calls: int | None = None) -> float:
        calls = calls or max(1, math.ceil(nbytes / bucket))  # default: one call per bucket
        return calls * collective_time(op, nbytes / calls, lay.dp, hw.link("dp", cross, op))

    m = lay.micro_batches(w.global_batch)
    grads, weights = psi * g_bytes, psi * w_bytes
    backward = compute_mb * (3 / 4 if lay.recompute == "full" else 2 / 3)
    after = 0.0  # collectives after the optimizer step, never hidden
    if lay.zero == 0:
        overlapped, window, tail = t("all_reduce", grads), backward, t("all_reduce", min(bucket, grads), 1)
    elif lay.zero in (1, 2):
        times = m if lay.zero == 2 else 1
        overlapped, window = times * t("reduce_scatter", grads), times * backward
        tail, after = t("reduce_scatter", min(bucket, grads), 1), t("all_gather", weights)
    else:
        units = max(layers, 1)
        gathers = 3 if lay.recompute == "full" else 2
        overlapped = m * (gathers * t("all_gather", weights, units) + t("reduce_scatter", grads, units))
        window = m * compute_mb
        tail = t("all_gather", weights / units, 1) + t("reduce_scatter", grads / units, 1)
    overlap = a.dp_overlap if a.dp_overlap is not None else (0.0 if hw.shared_node else DP_OVERLAP)
    return after + min(overlapped, max(tail, overlapped - overlap * window))


def step_time(w: Workload, layout: Layout, hw: Hardware, a: Assumptions = DEFAULTS) -> StepTime:
    """Predicted step time. The pipeline runs at its slowest stage: m slots of (compute + TP + p2p) plus
    the bubble; data-parallel tails and the optimizer step follow (the worst stage's). On a shared node every
    rank computes during the m slots and on average half of them during fill and drain; the step is then the
    longer of the critical path and the work, as the cores that idle ranks leave go to the others."""
    model, lay = w.model, layout
    busy_bubble = lay.gpus / 2 if lay.pp > 1 else lay.gpus
    bubble_speedup = time_share(hw, lay.gpus) / time_share(hw, busy_bubble)
    act = BYTES[w.precision][3]
    m = lay.micro_batches(w.global_batch)
    tokens = w.seq_len * lay.micro_batch
    rank = hw.per_rank(lay.gpus)
    layer_f, head_f, attention_f = _flops_split(model, w.seq_len)
    recompute_f = {"none": 0.0, "selective": 0.0 if a.flash_attention else attention_f, "full": layer_f / 3}
    layer_f += recompute_f[lay.recompute]

    activation = tokens * model.dim * act  # one micro-batch's hidden states, s·b·h
    tp_cross = crosses_nodes(lay, "tp", hw.gpus_per_node)
    tp_ops = ("all_gather", "reduce_scatter") if lay.sequence_parallel else ("all_reduce",)
    per_collective = sum(collective_time(op, activation, lay.tp, hw.link("tp", tp_cross, op)) for op in tp_ops)
    n_collectives = 6 if lay.recompute == "full" else 4  # per layer: 2 forward, 2 backward, 2 recompute
    tp_layer = n_collectives * per_collective * (1 - a.tp_overlap)
    # outside the layers, one call each: the vocab-parallel embedding's output (first stage) and the head
    # input's gradient (last stage); and the vocab-parallel loss's all-reduces of fp32 row max, then sum-exp
    # stacked with the target logit (last stage)
    tp_link = hw.link("tp", tp_cross, "all_reduce")
    tp_edge = per_collective / len(tp_ops) * (1 - a.tp_overlap)
    tp_loss = sum(collective_time("all_reduce", k * tokens * 4, lay.tp, tp_link) for k in (1, 2)) * (1 - a.tp_overlap)
    p2p = 0.0
    if lay.pp > 1:
        pp_link = hw.link("pp", crosses_nodes(lay, "pp", hw.gpus_per_node), "send_recv")
        # activations forward and gradients back, split over tp (scatter/gather), once per virtual stage
        p2p = 2 * lay.virtual_stages * collective_time("send_recv", activation / lay.tp, 2, pp_link)

    layers = stage_layers(model.n_layers, lay.pp, lay.virtual_stages)
    slot_compute = slot_tp = dp_comm = optimizer = 0.0
    for s in representative_stages(layers):
        last = s == lay.pp - 1
        flops = tokens * (layers[s] * layer_f + (head_f if last else 0.0)) / lay.tp
        compute_mb = micro_batch_time(flops, layers[s], hw, a, lay.gpus)
        tp_mb = layers[s] * tp_layer + (tp_edge if s == 0 else 0.0) + (tp_edge + tp_loss if last else 0.0)
        if compute_mb + tp_mb > slot_compute + slot_tp:
            slot_compute, slot_tp = compute_mb, tp_mb
        psi = stage_params(model, lay.tp, layers[s], s == 0, last)
        stage_dp = _dp_exposed(w, lay, hw, a, psi, layers[s], compute_mb)
        stage_optimizer = 2 * sum(model_state_bytes(psi, lay.dp, lay.zero, w.precision)) / rank.memory_bw
        if stage_dp + stage_optimizer > dp_comm + optimizer:
            dp_comm, optimizer = stage_dp, stage_optimizer

    slot = slot_compute + slot_tp + p2p
    v = lay.virtual_stages if lay.schedule == "interleaved" else 1
    # Critical path: m slots plus (p − 1)/v in fill and drain, each at the speed of a rank while the ranks of
    # half the stages compute; work: m slots at the speed while all compute. Both are lower bounds, and where
    # every rank owns its device the first is the larger: bubble = bubble_fraction × (m·slot + bubble).
    critical = (m + (lay.pp - 1) / v) * (slot_compute / bubble_speedup + slot_tp + p2p)
    bubble = max(0.0, critical - m * slot)
    total = m * slot + bubble + dp_comm + optimizer
    tokens_per_s = w.global_batch * w.seq_len / total
    tflops = flops_per_token(model, w.seq_len) * tokens_per_s / lay.gpus / 1e12
    return StepTime(
        compute=m * slot_compute,
        tp_comm=m * slot_tp,
        pp_comm=m * p2p,
        dp_comm=dp_comm,
        bubble=bubble,
        optimizer=optimizer,
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / rank.peak_flops,
        train_days=w.train_tokens / tokens_per_s / 86400,
    )
