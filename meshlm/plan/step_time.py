"""Time of one optimizer step for one layout: compute at an achievable rate plus fixed host time per
micro-batch, α–β collectives over the link each mesh dim crosses, the pipeline bubble, exposed data-parallel
communication, and the optimizer. On a shared node (cpu) ranks time-share the cores.

Formulas and sources: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from meshlm.model.config import ModelConfig
from meshlm.model.flops import flops_per_token, matmul_params
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan.attention import Kernel, kernel_flops
from meshlm.plan.exchanges import cp_layer_time, ep_layer_time
from meshlm.plan.gemm import MEMORY_EFFICIENCY, shape_efficiency
from meshlm.plan.hardware import Hardware
from meshlm.plan.memory import (
    BYTES,
    DEFAULTS,
    Assumptions,
    Candidate,
    Workload,
    layer_lora_params,
    model_state_bytes,
    moe_stage_params,
    moe_state_bytes,
    rank_moe_layers,
    stage_params,
)
from meshlm.plan.network import collective_time, crosses_nodes, group_time, rails
from meshlm.plan.pipeline_split import Runtime, chunk_full_layers, chunk_layers, rank_chunks, representative_stages

MEASURED_EFFICIENCY = 0.8  # achievable fraction of a measured large-matmul rate
DP_OVERLAP = 0.8  # NCCL runs on a few SMs beside compute; gloo on cpu competes for the same cores
# Activation elements per token that one layer's elementwise kernels read plus write in forward, as
# coefficients of (h replicated over tp unless sequence parallel, h split over tp plus this rank's KV width,
# I split over tp); backward moves about twice as much. meshlm: eager RMSNorm (fp32 upcast, square, mean,
# scale, downcast, weight: ~16h each), two residual adds (3h each), unfused rotary on Q and K (~10 per
# element) and the attention output's transpose, silu and product (5I). megatron: fused norms (2h each),
# residual adds, fused rotary (2 per element), fused SwiGLU (3I).
TRAFFIC: dict[str, tuple[float, float, float]] = {"meshlm": (38, 12, 5), "megatron": (10, 2, 3)}
# meshlm's zero-bubble executor splits the backward with autograd (docs/pipeline.md): B asks for the stage
# input's gradient only, W for the weights', walking the stage's graph again and so recomputing the chain of
# activation gradients that B computed (about the forward's work again). A slot of F + B + W is then four
# forwards' work instead of three: a third more compute (measured +36 % per step, docs/benchmarks.md).
ZB1_REWALK = 1 / 3
UNFUSED_ATTENTION = 4  # without flash: scores written, softmax read + written, probabilities read (a·s each)
# Attention-core FLOPs a causal flash kernel executes, over the training FLOPs `flops_per_token` counts (3× the
# forward over the full s×s square): it skips the masked half of the square, and its backward recomputes the
# scores, 2.5× the forward's matmuls instead of 2× (flash-attention's benchmarks/benchmark_flash_attention.py
# counts FLOPs so: 4·b·s²·h·d / (2 if causal), backward 2.5×). Published flash-attention rates are in that count.
CAUSAL_FLASH_WORK = 0.5 * 3.5 / 3


def fill_slots(schedule: str, pp: int, virtual_stages: int = 1) -> float:
    """Fill and drain of a pipeline step in micro-batch slots (F+B+W): p−1 for GPipe and 1F1B, (p−1)/v
    interleaved (Narayanan et al. 2021), (p−1)/3 for ZB-H1, whose idle time per rank is (p−1)(F+B−W) with
    the input- and weight-gradient passes each as costly as the forward (Qi et al. 2023)."""
    if schedule == "zb1":
        return (pp - 1) / 3
    return (pp - 1) / (virtual_stages if schedule == "interleaved" else 1)


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: fill and drain over the whole step (schedules.theoretical_bubble)."""
    fill = fill_slots(schedule, pp, virtual_stages)
    return fill / (micro_batches + fill)


@lru_cache(maxsize=1024)
def _flops_split(model: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """Training FLOPs per token of one layer and of the head, and forward attention-core FLOPs of one
    layer, all read off `flops_per_token` by differencing model sizes and sequence lengths. An MoE model's
    layer is its mean layer (`flops_per_token` counts active weights: router, top_k experts, shared expert),
    the head's 6·V·d taken off the whole."""
    if model.n_experts:
        head = 6.0 * model.vocab_size * model.dim
        forward = flops_per_token(model, seq_len, training=False)
        attention = (forward - flops_per_token(model, 0, training=False)) / model.n_layers
        return (flops_per_token(model, seq_len) - head) / model.n_layers, head, attention
    one, two = (flops_per_token(model.replace(n_layers=n), seq_len) for n in (1, 2))
    forward = flops_per_token(model, seq_len, training=False)
    attention = (forward - flops_per_token(model, 0, training=False)) / model.n_layers
    return two - one, 2 * one - two, attention


@dataclass(frozen=True)
class LayerWork:
    """What one layer costs per token on one tensor-parallel rank, forward + backward (+ recompute)."""

    gemm_flops: float  # projections, at the GEMM rate
    attention_flops: float  # QKᵀ and AV: at the flash-attention rate, or the GEMM rate when unfused
    memory_bytes: float  # elementwise kernels (norms, residuals, rotary, SwiGLU; unfused softmax), at HBM speed
    recompute_flops: float  # of the above FLOPs, those spent recomputing (hardware but not model FLOPs)


@lru_cache(maxsize=4096)
def layer_work(
    model: ModelConfig, seq_len: int, tp: int, sp: bool, recompute: str, flash: bool, runtime: Runtime, act: int
) -> LayerWork:
    """Per-token work of one layer: FLOPs from `flops_per_token` (model FLOPs, 3× the forward), plus the
    recomputed forward (full: the whole layer; selective: the attention core; mlp: the second RMSNorm, the
    residual add and the SwiGLU MLP, whose forward GEMMs are 2·3·h·I per token), and the bytes its elementwise
    kernels move (`TRAFFIC`; backward twice the forward)."""
    layer_f, _, attention_f = _flops_split(model, seq_len)
    gemm, attention = (layer_f - 3 * attention_f) / tp, 3 * attention_f / tp
    kv = max(model.n_kv_heads // tp, 1) * model.head_dim
    replicated, split, mlp = TRAFFIC[runtime]
    forward = replicated * model.dim / (tp if sp else 1) + split * (model.dim / tp + kv)
    forward += mlp * ffn_width(model) / tp
    softmax = 0.0 if flash else UNFUSED_ATTENTION * model.n_heads / tp * seq_len
    forward_bytes = (forward + softmax) * act
    extra_gemm = extra_attention = extra_bytes = 0.0
    if recompute == "full":
        extra_gemm, extra_attention, extra_bytes = gemm / 3, attention / 3, forward_bytes
    elif recompute == "selective":  # the runtime reruns the core under flash too (it only saves the statistics)
        extra_attention, extra_bytes = attention / 3, softmax * act
    elif recompute == "mlp":  # one of the two norms and residual adds (half the replicated traffic), the SwiGLU
        extra_gemm = 6 * model.dim * model.intermediate_size / tp
        extra_bytes = (replicated / 2 * model.dim / (tp if sp else 1) + mlp * model.intermediate_size / tp) * act
    return LayerWork(
        gemm + extra_gemm,
        attention + extra_attention,
        3 * forward_bytes + extra_bytes,
        extra_gemm + extra_attention,
    )


def ffn_width(model: ModelConfig) -> float:
    """SwiGLU width a token passes through in the mean layer: intermediate_size in a dense layer, k routed
    experts' and the shared expert's in an MoE layer (their elementwise traffic, `TRAFFIC`)."""
    n_moe = len(model.moe_layers)
    moe = model.top_k * model.moe_intermediate_size + model.shared_expert_intermediate_size
    return ((model.n_layers - n_moe) * model.intermediate_size + n_moe * moe) / model.n_layers


def mixed_work(work: LayerWork, full: LayerWork, share: float) -> LayerWork:
    """Per-layer average over a stage where a `share` of the layers are fully recomputed (`full`) and the rest
    follow the policy (`work`): `train.recompute_layers`."""
    if not share:
        return work
    names = [f.name for f in dataclasses.fields(LayerWork)]
    parts = zip((getattr(work, n) for n in names), (getattr(full, n) for n in names), strict=True)
    return LayerWork(*((1 - share) * x + share * y for x, y in parts))


def full_share(chunks: tuple[int, ...], recompute_layers: int) -> float:
    """Fraction of a pipeline rank's layers (`chunks`: its chunks' layer counts) that recompute_layers fully
    recomputes: the first N of each chunk."""
    return sum(chunk_full_layers(chunks, recompute_layers)) / max(sum(chunks), 1) if recompute_layers else 0.0


TP_COLLECTIVES = {"full": 6, "mlp": 5}  # per layer: 2 forward, 2 backward, and the recomputed forward's (else 4)


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
    hardware_tflops_per_gpu: float  # FLOPs executed, recomputation included (the HFU numerator)
    mfu: float
    train_days: float
    cp_comm: float = 0.0  # context-parallel ring send/recv or Ulysses all-to-alls, not overlapped
    ep_comm: float = 0.0  # expert-parallel dispatch and combine all-to-alls, not overlapped

    @property
    def total(self) -> float:
        parts = (self.compute, self.tp_comm, self.pp_comm, self.cp_comm, self.ep_comm, self.dp_comm, self.bubble)
        return sum(parts) + self.optimizer

    def parts(self) -> dict[str, float]:
        optional = tuple(name for name in ("cp_comm", "ep_comm") if getattr(self, name))
        names = ("compute", "tp_comm", "pp_comm", *optional, "dp_comm")
        return {name: getattr(self, name) for name in (*names, "bubble", "optimizer", "total")}


def fused_core(s: Candidate, a: Assumptions) -> bool:
    """Whether the attention core runs a fused (flash / memory-efficient) kernel: as the model's attention
    does (`Assumptions.flash_attention`), and always under cp, whose cores are meshlm's (ring attention's
    blocks through SDPA's fused kernels, Ulysses through SDPA)."""
    return a.flash_attention or s.cp > 1


def ring_core_time(w: Workload, s: Candidate, hw: Hardware, a: Assumptions) -> float:
    """Seconds of one layer's attention core (forward + backward, one micro-batch) on a cp rank, which the
    ring's hops hide behind (`cp_layer_time`): this rank's share of the causal attention FLOPs at the flash
    rate. 0 where nothing overlaps: without cp, and on a shared node, where gloo's transfers compete for
    the cores that compute (as `DP_OVERLAP`)."""
    if s.cp == 1 or hw.shared_node:
        return 0.0
    tokens = w.seq_len * s.micro_batch / s.cp
    attention = tokens * 3 * _flops_split(w.model, w.seq_len)[2] / s.tp
    return work_time(0.0, attention, 0.0, hw, a, True, w.seq_len / s.cp, w.model.head_dim)


def compute_rate(hw: Hardware, a: Assumptions) -> float:
    """Achievable GEMM FLOP/s of a training step on one device."""
    if hw.matmul_flops is not None:
        return hw.matmul_flops * (a.compute_efficiency or MEASURED_EFFICIENCY)
    return hw.peak_flops * (a.compute_efficiency or hw.gemm_efficiency)


@lru_cache(maxsize=4096)
def attention_fraction(hw: Hardware, kernel: Kernel, seq_len: float, head_dim: int) -> float:
    """The flash kernel's rate over the GEMM rate: its published forward + backward rate at this sequence
    length and head dimension (`meshlm.plan.attention`) over the device's best GEMM kernel's (MAMF), so the
    step's efficiency applies to both; `attention_efficiency` on a device without published figures."""
    if hw.attention_chip is None or hw.matmul_max is None:
        return hw.attention_efficiency
    return kernel_flops(hw.attention_chip, kernel, seq_len, head_dim) / hw.matmul_max


def work_time(
    gemm: float,
    attention: float,
    nbytes: float,
    hw: Hardware,
    a: Assumptions,
    flash: bool,
    seq_len: float,
    head_dim: int,
) -> float:
    """Seconds of device work for a rank alone: GEMM FLOPs at the GEMM rate, attention-core FLOPs (the full
    square, `flops_per_token`'s count) as a causal flash kernel runs them (`CAUSAL_FLASH_WORK`) at the
    flash-attention rate for the kernel's `seq_len` and `head_dim` (`attention_fraction`), or unfused, the
    whole square at the GEMM rate; elementwise bytes at the achievable bandwidth."""
    alone = hw.per_rank(1)
    rate = compute_rate(alone, a)
    if flash:
        core = attention * CAUSAL_FLASH_WORK / (rate * attention_fraction(hw, a.attention_kernel, seq_len, head_dim))
    else:
        core = attention / rate
    return gemm / rate + core + nbytes / (alone.memory_bw * MEMORY_EFFICIENCY)


def time_share(hw: Hardware, busy: float) -> float:
    """How many times slower than alone a single-threaded rank runs while `busy` ranks compute: on a shared
    node max(1, busy / cores), the cores being time-shared; 1 where every rank owns its device."""
    return max(1.0, busy / hw.cores) if hw.shared_node else 1.0


def micro_batch_time(work_s: float, layers: int, hw: Hardware, busy: float) -> float:
    """One micro-batch's forward + backward on one rank: `work_s` of device work (`work_time`), plus the
    size-independent host time (layers·layer_overhead + micro_batch_overhead). On a shared node the same
    thread does both, so they add, and time-sharing stretches both; on a GPU kernels run asynchronously
    behind the host, so the larger of the two counts."""
    host = layers * hw.layer_overhead_s + hw.micro_batch_overhead_s
    if hw.shared_node:
        return (work_s + host) * time_share(hw, busy)
    return max(work_s, host)


def _dp_exposed(
    w: Workload,
    s: Candidate,
    hw: Hardware,
    a: Assumptions,
    psi: float,
    layers: int,
    compute_mb: float,
    trainable: float | None = None,
    group: str = "replicas",
    share: float = 0.0,
) -> float:
    """Data-parallel communication left on the critical path. Gradients are reduced in buckets that hide
    behind backward (a.dp_overlap of it) except the last; ZeRO-1/2 all-gather updated weights after the
    step; ZeRO-2 reduce-scatters every micro-batch (sharded gradients cannot accumulate); ZeRO-3 gathers
    and reduces layer by layer, in forward and backward (a recomputed forward runs inside the backward that
    has its unit gathered), every micro-batch (under pp too), prefetched except the first unit of each
    micro-batch's forward and backward and its last reduce-scatter; with `backward_prefetch` "post" (FSDP1's
    BACKWARD_POST) its backward gathers are not hidden at all. Every bucket or layer is its own
    collective and pays the latency term again (`dp_collectives`). Of the `psi` weights only `trainable`
    (default all; LoRA: the adapters) are reduced and, under ZeRO-1/2, gathered after the step; ZeRO-3
    gathers all of them. `group` is the reducing group: "replicas" (dp × ep × cp, the dense weights) or
    "expert_replicas" (dp × cp, the expert shards). `share`: the stage's fraction of fully recomputed layers
    (`train.recompute_layers`)."""
    n = s.expert_replicas if group == "expert_replicas" else s.replicas
    if n == 1 or psi == 0:
        return 0.0
    m = s.micro_batches(w.global_batch)
    after, overlapped, tail = dp_collectives(w, s.mesh, s.zero, m, psi, trainable, layers, group, hw, a)
    full = 1.0 if s.recompute == "full" else share  # fraction of layers whose whole forward is rerun
    backward = compute_mb * (2 + full) / (3 + full)
    if s.zero == 0:
        window = backward
    elif s.zero in (1, 2):
        window = (m if s.zero == 2 else 1) * backward
    else:
        window = m * compute_mb
    overlap = a.dp_overlap if a.dp_overlap is not None else (0.0 if hw.shared_node else DP_OVERLAP)
    return after + min(overlapped, max(tail, overlapped - overlap * window))


@lru_cache(maxsize=16384)
def dp_collectives(
    w: Workload,
    mesh: Layout,
    zero: int,
    micro_batches: int,
    psi: float,
    trainable: float | None,
    layers: int,
    group: str,
    hw: Hardware,
    a: Assumptions,
) -> tuple[float, float, float]:
    """Seconds of a stage's data-parallel collectives per step (`_dp_exposed`), whatever the compute they hide
    behind: (never hidden: after the optimizer step, or ZeRO-3's backward gathers under FSDP1's BACKWARD_POST;
    those that backward can hide; the tail that it cannot)."""
    n = mesh.dp * mesh.cp if group == "expert_replicas" else mesh.dp * mesh.ep * mesh.cp
    w_bytes, g_bytes, _, _ = BYTES[w.precision]
    cross = crosses_nodes(mesh, group, hw.gpus_per_node)
    nics = rails(mesh, group, hw.gpus_per_node) if cross else 1
    bucket = a.bucket_mb * 1e6

    def t(op: str, nbytes: float, calls: int | None = None) -> float:
        calls = calls or max(1, math.ceil(nbytes / bucket))  # default: one call per bucket
        return calls * group_time(hw, "dp", cross, op, nbytes / calls, n, nics)

    m = micro_batches
    trainable = psi if trainable is None else trainable
    grads, weights, updated = trainable * g_bytes, psi * w_bytes, trainable * w_bytes
    after = 0.0  # collectives after the optimizer step, never hidden
    if zero == 0:
        overlapped, tail = t("all_reduce", grads), t("all_reduce", min(bucket, grads), 1)
    elif zero in (1, 2):
        times = m if zero == 2 else 1
        overlapped = times * t("reduce_scatter", grads)
        tail, after = t("reduce_scatter", min(bucket, grads), 1), t("all_gather", updated)
    else:
        units = max(layers, 1)
        gathers = 2.0  # the recompute forward runs inside the unit's backward, which has it gathered
        overlapped = m * (gathers * t("all_gather", weights, units) + t("reduce_scatter", grads, units))
        # every micro-batch starts its forward and its backward with a blocking gather of the first unit (the
        # last one was freed after use, meshlm.parallel.dp.zero.Zero3Hooks) and ends with one reduce-scatter
        tail = m * (2 * t("all_gather", weights / units, 1) + t("reduce_scatter", grads / units, 1))
        if a.backward_prefetch == "post":  # FSDP1's BACKWARD_POST: each backward gather after the last unit's
            backward = m * t("all_gather", weights, units)  # gradients, before its own: none hidden
            overlapped, tail, after = overlapped - backward, tail - m * t("all_gather", weights / units, 1), backward
    return after, overlapped, tail


@lru_cache(maxsize=1024)
def lora_flops_per_token(model: ModelConfig, seq_len: int, lora_rank: int = 0) -> float:
    """Training FLOPs per token (`flops_per_token`); with LoRA (rank > 0) less the frozen matrices' weight
    gradients (2 FLOPs per matrix weight) plus the adapters' forward and backward (6 per adapter weight)."""
    full = flops_per_token(model, seq_len)
    if not lora_rank:
        return full
    return full - 2.0 * matmul_params(model) + 6.0 * model.n_layers * layer_lora_params(model, 1, lora_rank)


def step_time(w: Workload, strategy: Candidate, hw: Hardware, a: Assumptions = DEFAULTS) -> StepTime:
    """Predicted step time. The pipeline runs at its slowest stage: m slots of (compute + TP + p2p) plus
    the bubble; data-parallel tails and the optimizer step follow (the worst stage's). On a shared node every
    rank computes during the m slots and on average half of them during fill and drain; the step is then the
    longer of the critical path and the work, as the cores that idle ranks leave go to the others.

    The slots (`stage_slots`) do not depend on the schedule or the ZeRO stage, nor the data-parallel tail
    (`stage_tail`) on the schedule, so strategies that differ only there share them."""
    model, s = w.model, strategy
    shape = (s.mesh, s.micro_batch, s.virtual_stages, s.recompute, s.sequence_parallel, s.cp_attention)
    slots = stage_slots(w, *shape, s.recompute_layers, hw, a)
    dp_comm, optimizer = stage_tail(w, *shape, s.recompute_layers, s.zero, hw, a)
    slot_compute, slot_tp, slot_cp, slot_ep = slots.critical
    p2p = slots.p2p
    busy_bubble = s.gpus / 2 if s.pp > 1 else s.gpus
    bubble_speedup = time_share(hw, s.gpus) / time_share(hw, busy_bubble)
    m = s.micro_batches(w.global_batch)

    slot = slot_compute + slot_tp + slot_cp + slot_ep + p2p
    # Critical path: m slots plus the fill and drain (fill_slots), each at the speed of a rank while the ranks
    # of half the stages compute; work: m slots at the speed while all compute. Both are lower bounds, and
    # where every rank owns its device the first is the larger: bubble = bubble_fraction × (m·slot + bubble).
    fill = fill_slots(s.schedule, s.pp, s.virtual_stages)
    critical = (m + fill) * (slot_compute / bubble_speedup + slot_tp + slot_cp + slot_ep + p2p)
    bubble = max(0.0, critical - m * slot)
    # zb1's W pass re-walks the activation gradients: more work in every slot, none of it taken off the bubble
    rewalk = ZB1_REWALK * slot_compute if s.schedule == "zb1" else 0.0
    slot_compute += rewalk
    total = m * (slot + rewalk) + bubble + dp_comm + optimizer
    tokens_per_s = w.global_batch * w.seq_len / total
    model_flops = lora_flops_per_token(model, w.seq_len, w.lora_rank)
    tflops = model_flops * tokens_per_s / s.gpus / 1e12
    return StepTime(
        compute=m * slot_compute,
        tp_comm=m * slot_tp,
        pp_comm=m * p2p,
        cp_comm=m * slot_cp,
        ep_comm=m * slot_ep,
        dp_comm=dp_comm,
        bubble=bubble,
        optimizer=optimizer,
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=tflops,
        hardware_tflops_per_gpu=tflops * (model_flops + slots.recomputed) / model_flops * (1 + rewalk / slot),
        mfu=tflops * 1e12 / hw.per_rank(s.gpus).peak_flops,
        train_days=w.train_tokens / tokens_per_s / 86400,
    )


class Stage(NamedTuple):
    """One representative pipeline stage's share of a slot: one micro-batch's forward + backward."""

    index: int
    layers: int
    moe_layers: int
    share: float  # of its layers, the fraction fully recomputed (`full_share`)
    compute: float  # seconds of compute (`micro_batch_time`)


class Slots(NamedTuple):
    """What a strategy's micro-batch costs, stage by stage, without the schedule and the ZeRO stage."""

    stages: tuple[Stage, ...]
    critical: tuple[float, float, float, float]  # the slowest stage's (compute, tp, cp, ep) seconds
    p2p: float  # pipeline send/recv per micro-batch
    recomputed: float  # FLOPs per token spent recomputing, over the model (hardware, not model, FLOPs)


def _layer_works(w: Workload, s: Candidate, a: Assumptions) -> tuple[list[LayerWork], float]:
    """Per-token work of a layer under the strategy's recompute policy and, with recompute_layers, of a fully
    recomputed one (else the policy's again, last), and the head's FLOPs on one tensor-parallel rank."""
    model, act = w.model, BYTES[w.precision][3]
    policies = (s.recompute, "full") if s.recompute_layers else (s.recompute,)
    works = [
        layer_work(model, w.seq_len, s.tp, s.sequence_parallel, r, fused_core(s, a), a.runtime, act) for r in policies
    ]
    head_f = _flops_split(model, w.seq_len)[1] / s.tp
    if a.moe_rows != 1.0:  # a capacity factor: the routed experts compute moe_rows of the k rows a token
        pairs = zip(works, policies, strict=True)
        works = [_capacity_rows(work, model, s, policy, a.moe_rows) for work, policy in pairs]
    if w.lora_rank:  # a frozen base: no weight-gradient GEMMs (a third of its matmuls), plus the adapters' own
        layer_f, _, attention_f = _flops_split(model, w.seq_len)
        adapters = 6.0 * layer_lora_params(model, 1, w.lora_rank) / s.tp
        less = -(layer_f - 3 * attention_f) / s.tp / 3 + adapters
        works = [dataclasses.replace(work, gemm_flops=work.gemm_flops + less) for work in works]
        head_f *= 2 / 3
    return works, head_f


def _capacity_rows(work: LayerWork, model: ModelConfig, s: Candidate, policy: str, rows: float) -> LayerWork:
    """A mean layer's work with its routed experts computing `rows` of the k rows per token dropless routing
    gives them (`Assumptions.moe_rows`): their 6·k·3·h·I_moe training FLOPs per token and MoE layer (8 with
    the forward rerun by full or 'mlp' recompute) scale by it. The recomputed share moves with it."""
    per_token = 6 * model.top_k * 3 * model.dim * model.moe_intermediate_size / s.tp
    share = len(model.moe_layers) / model.n_layers
    rerun = 1 / 3 if policy in ("full", "mlp") else 0.0
    delta = (rows - 1) * per_token * share
    return dataclasses.replace(
        work,
        gemm_flops=work.gemm_flops + delta * (1 + rerun),
        recompute_flops=work.recompute_flops + delta * rerun,
    )


def _tp_times(w: Workload, s: Candidate, hw: Hardware, a: Assumptions) -> tuple[float, float, float, float]:
    """Exposed tensor-parallel seconds per micro-batch: of a layer under the policy, of a fully recomputed
    layer, of the stage edge (the vocab-parallel embedding's output on the first stage, the head input's
    gradient on the last), and of the vocab-parallel loss's all-reduces (fp32 row max, then sum-exp stacked
    with the target logit; last stage)."""
    tokens = w.seq_len * s.micro_batch / s.cp
    activation = tokens * w.model.dim * BYTES[w.precision][3]  # one micro-batch's hidden states, s·b·h
    tp_cross = crosses_nodes(s.mesh, "tp", hw.gpus_per_node)
    tp_ops = ("all_gather", "reduce_scatter") if s.sequence_parallel else ("all_reduce",)
    per_collective = sum(group_time(hw, "tp", tp_cross, op, activation, s.tp, s.tp) for op in tp_ops)
    n_collectives = TP_COLLECTIVES.get(s.recompute, 4)
    tp_layer = n_collectives * per_collective * (1 - a.tp_overlap)
    tp_full_layer = TP_COLLECTIVES["full"] * per_collective * (1 - a.tp_overlap)
    tp_edge = per_collective / len(tp_ops) * (1 - a.tp_overlap)
    loss = (group_time(hw, "tp", tp_cross, "all_reduce", k * tokens * 4, s.tp, s.tp) for k in (1, 2))
    tp_loss = sum(loss) * (1 - a.tp_overlap)
    return tp_layer, tp_full_layer, tp_edge, tp_loss


def _p2p_time(w: Workload, s: Candidate, hw: Hardware) -> float:
    """Pipeline send/recv per micro-batch: activations forward and gradients back, split over tp
    (scatter/gather), once per virtual stage."""
    if s.pp == 1:
        return 0.0
    activation = w.seq_len * s.micro_batch / s.cp * w.model.dim * BYTES[w.precision][3]
    pp_link = hw.link("pp", crosses_nodes(s.mesh, "pp", hw.gpus_per_node), "send_recv")
    return 2 * s.virtual_stages * collective_time("send_recv", activation / s.tp, 2, pp_link)


def _strategy(
    mesh: Layout,
    micro_batch: int,
    virtual_stages: int,
    recompute: str,
    sp: bool,
    cp_attention: str,
    recompute_layers: int,
    zero: int = 0,
) -> Candidate:
    """The strategy of these fields; its schedule (and, unless given, ZeRO stage) is a placeholder that the
    callers do not read."""
    options = ParallelOptions(zero=zero, virtual_stages=virtual_stages, sequence_parallel=sp, cp_attention=cp_attention)
    return Candidate(mesh, options, micro_batch, recompute, recompute_layers)


@lru_cache(maxsize=16384)
def stage_slots(
    w: Workload,
    mesh: Layout,
    micro_batch: int,
    virtual_stages: int,
    recompute: str,
    sp: bool,
    cp_attention: str,
    recompute_layers: int,
    hw: Hardware,
    a: Assumptions,
) -> Slots:
    """Per representative pipeline stage, one micro-batch's compute (device work at the rates of `work_time`
    plus host time), tensor-, context- and expert-parallel communication; the slowest stage's; the pipeline
    send/recv; and the recomputed FLOPs per token."""
    s = _strategy(mesh, micro_batch, virtual_stages, recompute, sp, cp_attention, recompute_layers)
    model, act = w.model, BYTES[w.precision][3]
    tokens = w.seq_len * s.micro_batch / s.cp  # this rank's tokens of a micro-batch (all of them without cp)
    works, head_f = _layer_works(w, s, a)
    full_work = works[-1]  # the policy's own when no block is fully recomputed
    loss_bytes = 3 * (act + 8) * model.vocab_size / s.tp  # logits, their fp32 copy and log-softmax, fwd + bwd
    tp_layer, tp_full_layer, tp_edge, tp_loss = _tp_times(w, s, hw, a)
    chunks = rank_chunks(model, s.pp, s.virtual_stages, a.runtime)
    moe = rank_moe_layers(model, s.pp, s.virtual_stages, a.runtime)
    core = ring_core_time(w, s, hw, a)
    cp_layer = cp_layer_time(model, tokens, s, hw, act, core)
    ep_layer = ep_layer_time(model, tokens, s, hw, act, a.runtime, a.moe_dispatcher, a.moe_rows)
    cp_full_layer = ep_full_layer = 0.0
    if s.recompute_layers:
        full_s = dataclasses.replace(s, recompute="full")
        cp_full_layer = cp_layer_time(model, tokens, full_s, hw, act, core)
        ep_full_layer = ep_layer_time(model, tokens, full_s, hw, act, a.runtime, a.moe_dispatcher, a.moe_rows)
    # GEMMs priced at their shapes' rate (`meshlm.plan.gemm`): FLOPs over that fraction of a large GEMM's rate
    layer_shape, head_shape = shape_efficiency(model, tokens, s.tp, s.ep, a.runtime, hw, a.moe_rows)
    # the sequence one attention kernel call sees: a ring rank's chunk (its blocks are of it), Ulysses' whole
    kernel_seq = w.seq_len / s.cp if s.cp_attention == "ring" else w.seq_len
    stages = []
    slot_compute = slot_tp = slot_cp = slot_ep = 0.0
    for i in representative_stages(chunks):
        layers, last = sum(chunks[i]), i == s.pp - 1
        share = full_share(chunks[i], s.recompute_layers)
        work = mixed_work(works[0], full_work, share)
        gemm = tokens * (layers * work.gemm_flops / layer_shape + (head_f / head_shape if last else 0.0))
        nbytes = tokens * (layers * work.memory_bytes + (loss_bytes if last else 0.0))
        attention = tokens * layers * work.attention_flops
        device = work_time(gemm, attention, nbytes, hw, a, fused_core(s, a), kernel_seq, model.head_dim)
        compute_mb = micro_batch_time(device, layers, hw, s.gpus)
        tp_mb = layers * ((1 - share) * tp_layer + share * tp_full_layer)
        tp_mb += (tp_edge if i == 0 else 0.0) + (tp_edge + tp_loss if last else 0.0)
        cp_mb = layers * ((1 - share) * cp_layer + share * cp_full_layer)
        ep_mb = moe[i] * ((1 - share) * ep_layer + share * ep_full_layer)
        if compute_mb + tp_mb + cp_mb + ep_mb > slot_compute + slot_tp + slot_cp + slot_ep:
            slot_compute, slot_tp, slot_cp, slot_ep = compute_mb, tp_mb, cp_mb, ep_mb
        stages.append(Stage(i, layers, moe[i], share, compute_mb))
    fully = sum(chunk_full_layers(chunk_layers(model, s.pp * s.virtual_stages, a.runtime), s.recompute_layers))
    recomputed = ((model.n_layers - fully) * works[0].recompute_flops + fully * full_work.recompute_flops) * s.tp
    critical = (slot_compute, slot_tp, slot_cp, slot_ep)
    return Slots(tuple(stages), critical, _p2p_time(w, s, hw), recomputed)


@lru_cache(maxsize=16384)
def stage_tail(
    w: Workload,
    mesh: Layout,
    micro_batch: int,
    virtual_stages: int,
    recompute: str,
    sp: bool,
    cp_attention: str,
    recompute_layers: int,
    zero: int,
    hw: Hardware,
    a: Assumptions,
) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) in seconds of the stage where they take longest
    together: the data-parallel / ZeRO collectives left on the critical path (`_dp_exposed`, dense weights
    over the data replicas and expert shards over dp × cp) and the optimizer reading and writing its states."""
    s = _strategy(mesh, micro_batch, virtual_stages, recompute, sp, cp_attention, recompute_layers, zero)
    slots = stage_slots(w, mesh, micro_batch, virtual_stages, recompute, sp, cp_attention, recompute_layers, hw, a)
    model, rank = w.model, hw.per_rank(s.gpus)
    dp_comm = optimizer = 0.0
    for i, layers, moe, share, compute_mb in slots.stages:
        last = i == s.pp - 1
        psi = stage_params(model, s.tp, layers, i == 0, last)
        if model.n_experts:  # dense weights reduced over dp × ep × cp, expert shards over dp × cp
            dense, experts = moe_stage_params(model, s.tp, s.ep, layers, moe, i == 0, last)
            stage_dp = _dp_exposed(w, s, hw, a, dense, layers, compute_mb, share=share)
            stage_dp += _dp_exposed(w, s, hw, a, experts, layers, compute_mb, group="expert_replicas", share=share)
            states = moe_state_bytes(dense, experts, s, w.precision, a.runtime)
        elif w.lora_rank:
            psi_lora = layers * layer_lora_params(model, s.tp, w.lora_rank)
            stage_dp = _dp_exposed(w, s, hw, a, psi, layers, compute_mb, trainable=psi_lora, share=share)
            states = model_state_bytes(psi_lora, s.replicas, s.zero, w.precision, a.runtime)
        else:
            stage_dp = _dp_exposed(w, s, hw, a, psi, layers, compute_mb, share=share)
            states = model_state_bytes(psi, s.replicas, s.zero, w.precision, a.runtime)
        stage_optimizer = 2 * sum(states) / rank.memory_bw
        if stage_dp + stage_optimizer > dp_comm + optimizer:
            dp_comm, optimizer = stage_dp, stage_optimizer
    return dp_comm, optimizer
