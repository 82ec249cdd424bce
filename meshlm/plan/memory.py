"""Memory per device of one strategy: model states by ZeRO stage, activations by recompute policy and
pipeline schedule, the loss's logits, transient buffers, and framework overhead.

The pipeline split and the schedule are the runtime's own (`meshlm.parallel.pp.stages.stage_layers`,
`meshlm.parallel.pp.schedules.compute_order`), so the planner predicts memory for the split and the order of
micro-batches that actually run. Every formula and its source is in docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from meshlm.model.config import ModelConfig
from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan.attention import Kernel
from meshlm.plan.hardware import GB, Hardware
from meshlm.plan.pipeline_split import (
    Runtime,
    ScheduleName,
    chunk_layers,
    held_layers,
    rank_chunks,
    recomputed_activations,
    representative_stages,
)

Precision = Literal["bf16", "fp32"]
Recompute = Literal["none", "selective", "mlp", "full"]
Dispatcher = Literal["alltoall", "allgather"]  # expert-parallel token dispatch (Megatron's two)

# Bytes per parameter of (weights, gradients, optimizer state) and per stored activation element.
# bf16: mixed-precision Adam as in the ZeRO paper (2Ψ + 2Ψ + 12Ψ: fp32 master, m, v).
# fp32: what meshlm runs on CPU (4Ψ + 4Ψ + 8Ψ: fp32 m, v; the weights are the master copy).
BYTES: dict[str, tuple[int, int, int, int]] = {"bf16": (2, 2, 12, 2), "fp32": (4, 4, 8, 4)}
LOSS_CHUNK_BYTES = 1 << 30  # fp32 logits per chunk of the fused loss: meshlm.parallel.transforms.fused_loss.CHUNK_BYTES


@dataclass(frozen=True)
class Workload:
    """What to train: a model shape, sequences of seq_len tokens, global_batch sequences per step."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    train_tokens: float
    precision: Precision = "bf16"
    name: str = "model"
    lora_rank: int = (
        0  # > 0: LoRA on the attention and MLP projections; the base is frozen (meshlm.parallel.transforms.lora)
    )


@dataclass(frozen=True)
class Candidate:
    """How to run a workload: the runtime's device mesh (pp outer, dp, ep, cp, tp inner), the engine's options it
    sets (meshlm.parallel.options.ParallelOptions: the ZeRO stage, the pipeline schedule and virtual stages,
    sequence parallelism, the context-parallel attention; the rest at their defaults), and the choices that are
    the run config's [train] fields (the micro-batch, activation recomputation)."""

    mesh: Layout = field(default_factory=Layout)
    options: ParallelOptions = field(default_factory=ParallelOptions)
    micro_batch: int = 1
    recompute: Recompute = "none"
    recompute_layers: int = 0  # the first N layers of each pipeline chunk fully recomputed, the rest `recompute`

    # The options the planner reads, named as in the formulas (read-only: a candidate's options are its `options`).
    @property
    def zero(self) -> int:
        return self.options.zero

    @property
    def schedule(self) -> ScheduleName:
        return self.options.schedule

    @property
    def virtual_stages(self) -> int:
        return self.options.virtual_stages

    @property
    def sequence_parallel(self) -> bool:
        return self.options.sequence_parallel

    @property
    def cp_attention(self) -> Literal["ring", "ulysses"]:
        return self.options.cp_attention

    def with_options(self, **changes: object) -> Candidate:
        """This candidate with some of its options changed (validated as ParallelOptions are)."""
        return dataclasses.replace(self, options=ParallelOptions(**{**self.options.model_dump(), **changes}))

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def cp(self) -> int:
        return self.mesh.cp

    @property
    def ep(self) -> int:
        return self.mesh.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense weights, which reduce their gradients and shard their ZeRO state
        together: dp × ep × cp (without ep, dp × cp)."""
        return self.mesh.dp * self.mesh.ep * self.mesh.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same expert shards (the expert-data-parallel group): dp × cp."""
        return self.mesh.dp * self.mesh.cp

    @property
    def gpus(self) -> int:
        return self.mesh.world_size

    @property
    def layout(self) -> str:
        """The `parallel.layout` string, e.g. 'pp=2,dp=4,tp=8'."""
        return str(self.mesh)

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.mesh.data_parallel * self.micro_batch)

    def overrides(self) -> dict[str, object]:
        """The meshlm config fields (`section.field`) that select this strategy in the trainer."""
        fields = {
            "parallel.layout": self.layout,
            "parallel.zero": self.zero,
            "parallel.schedule": self.schedule,
            "parallel.virtual_stages": self.virtual_stages,
            "parallel.sequence_parallel": self.sequence_parallel,
            "train.micro_batch": self.micro_batch,
            "train.recompute": self.recompute,
        }
        if self.cp > 1:
            fields["parallel.cp_attention"] = self.cp_attention
        if self.recompute_layers:  # else the default 0 (launch files name only what the plan sets)
            fields["train.recompute_layers"] = self.recompute_layers
        return fields

    def __str__(self) -> str:
        sched = f"{self.schedule}×{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        sp = " sp" if self.sequence_parallel else ""
        attention = f" {self.cp_attention}" if self.cp > 1 else ""
        recompute = self.recompute + (f"+{self.recompute_layers}full" if self.recompute_layers else "")
        return f"{self.layout}{attention} zero={self.zero} mb={self.micro_batch} {sched} recompute={recompute}{sp}"


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the model that are not hardware figures; defaults and their reasons in docs/planner.md."""

    runtime: Runtime = "meshlm"  # whose kernels and pipeline split run the step
    flash_attention: bool = True  # SDPA flash / memory-efficient kernels: no s² attention matrix stored
    attention_kernel: Kernel = "flash2"  # whose flash kernel runs it: its published rate (plan/attention.py)
    overhead_gb: float | None = None  # fixed per-device overhead; None: the device's framework_bytes
    overhead_fraction: float = 0.05  # allocator fragmentation, as a fraction of everything else
    compute_efficiency: float | None = None  # GEMM rate / peak; None: the device's, or 0.8 of a measured rate
    dp_overlap: float | None = None  # fraction of backward that hides DP communication; None: 0.8, cpu 0
    tp_overlap: float = 0.0  # fraction of tensor-parallel communication hidden behind compute
    bucket_mb: float = 25.0  # last gradient bucket, never hidden
    fused_loss: bool = True  # meshlm's train.fused_loss (the megatron runtime's loss is unfused)
    backward_prefetch: Literal["pre", "post"] = "pre"  # ZeRO-3 backward gathers: prefetched, or FSDP1's POST
    moe_dispatcher: Dispatcher = "alltoall"  # Megatron's --moe-token-dispatcher-type (meshlm's: all-to-all)
    moe_capacity_factor: float | None = None  # Megatron's --moe-expert-capacity-factor; None: dropless
    moe_pad_to_capacity: bool = False  # Megatron's --moe-pad-expert-input-to-capacity

    @property
    def moe_rows(self) -> float:
        """Routed rows an expert-parallel rank sends and its experts compute, over the k per token of
        dropless routing, under balanced routing: Megatron's capacity is ceil(k·tokens/E · factor) rows per
        expert, so padded to it a rank sends `factor` times the rows, dropped to it min(1, factor) of them."""
        if self.moe_capacity_factor is None:
            return 1.0
        return self.moe_capacity_factor if self.moe_pad_to_capacity else min(1.0, self.moe_capacity_factor)

    @property
    def fused(self) -> bool:
        return self.fused_loss and self.runtime == "meshlm"


DEFAULTS = Assumptions()


@lru_cache(maxsize=1024)
def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one layer on one tensor-parallel rank. KV heads are split over tp when there are
    enough of them, else replicated so each rank holds one (needs tp % n_kv_heads == 0)."""
    d, hd = model.dim, model.head_dim
    kv_heads = max(model.n_kv_heads // tp, 1)
    attention = 2 * d * model.n_heads * hd // tp + 2 * d * kv_heads * hd
    if model.qkv_bias:  # Qwen2: q/k/v biases split with their weights
        attention += (model.n_heads // tp + 2 * kv_heads) * hd
    mlp = 3 * d * model.intermediate_size // tp
    return attention + mlp + 2 * d


def stage_params(model: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> int:
    """Ψ of one rank: its layers, the vocab-parallel embedding on the first stage, the final norm and head
    on the last. A tied head on a different stage from the embedding is a second copy (as in Megatron)."""
    n = layers * layer_params(model, tp)
    table = model.vocab_size * model.dim // tp
    if first:
        n += table
    if last:
        n += model.dim + (0 if first and model.tie_embeddings else table)
    return n


def model_state_bytes(
    psi: float, dp: int, zero: int, precision: Precision, runtime: Runtime = "meshlm", grad_accum_dtype: str = "fp32"
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes: stage 1 shards the optimizer over dp, 2 also the gradients,
    3 also the weights (Rajbhandari et al. 2020).

    The Megatron-style runtime counts what Megatron-LM documents for its distributed optimizer
    (docs/source/api-guide/dist_optimizer.md): bf16 weights and an fp32 gradient buffer, with the fp32 master
    and Adam's moments sharded over dp, 6 + 12/d bytes per parameter (18 unsharded); ZeRO-2 also shards the
    gradient buffer. Its ZeRO-3 is FSDP's FULL_SHARD (the MPT rows of docs/planner.md; FSDP2 alike): fp32
    sharded weights, which are the master copy, fp32 sharded gradients and moments, 16/d. fp32 training
    counts BYTES (4 + 4 + 8) for both. meshlm's runtime holds what its flat buffers
    hold (docs/zero.md, checked against the real tensors by tests/parallel/test_zero_bytes.py): zero 0 steps the fp32
    weights under autocast (4 + 4 + 8); under ZeRO ≥ 1 AdamW's moments (8) shard, with fp32 master and
    reduced-gradient shards (4 + 4 per dp) beside full working weights and gradients of
    `parallel.zero_param_dtype` (bf16 in `bf16` precision, else fp32, when the masters are views of them),
    which ZeRO-2 frees after the reduction and ZeRO-3 gathers only for use. The full gradient buffer is in
    `parallel.grad_accum_dtype`: float32 (ZeRO-1 then keeps its reduced shard inside it: 4 bytes) or bf16
    beside the fp32 shard (2 + 4/dp)."""
    if runtime == "megatron":
        w, g, o, _ = BYTES[precision]
        if precision == "bf16":
            w, g, o = (4, 4, 8) if zero == 3 else (2, 4, 12)
        return (
            w * psi / (dp if zero >= 3 else 1),
            g * psi / (dp if zero >= 2 else 1),
            o * psi / (dp if zero >= 1 else 1),
        )
    if zero == 0:
        return 4 * psi, 4 * psi, 8 * psi
    shard = psi / dp
    if zero == 3:
        return 4 * shard, 4 * shard, 8 * shard
    working = BYTES[precision][0]
    master = 4 * shard if working != 4 else 0.0
    full = working * psi + master  # weights (zero 1 and 2): full, plus the fp32 master shard
    grads = full if grad_accum_dtype == "bf16" else 4 * psi  # zero 1: the full buffer (and fp32 shard)
    return full, grads if zero == 1 else 4 * shard, 8 * shard


def layer_lora_params(model: ModelConfig, tp: int, rank: int) -> int:
    """LoRA adapter parameters of one layer on one tensor-parallel rank (meshlm.parallel.transforms.lora on the 7
    projections): a column-parallel projection (q, k, v, gate, up) holds its replicated A (rank × in) and its rows
    of B, a row-parallel one (o, down) its columns of A and the replicated B (rank × out)."""
    d, hd, r = model.dim, model.head_dim, rank
    kv = max(model.n_kv_heads // tp, 1) * hd
    mlp = model.intermediate_size // tp
    column = (r * d + r * model.n_heads * hd // tp) + 2 * (r * d + r * kv) + 2 * (r * d + r * mlp)
    row = (r * model.n_heads * hd // tp + r * d) + (r * mlp + r * d)
    return column + row


def lora_state_bytes(
    psi: float, psi_lora: float, replicas: int, zero: int, precision: Precision, grad_accum_dtype: str = "fp32"
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of a LoRA rank: the frozen base in the working dtype (bf16: no
    fp32 master), sharded under ZeRO-3 only, with no gradient and no optimizer state; the adapters as any
    trainable weights (`model_state_bytes`)."""
    weights, grads, optimizer = model_state_bytes(
        psi_lora, replicas, zero, precision, grad_accum_dtype=grad_accum_dtype
    )
    base = BYTES[precision][0] * psi / (replicas if zero >= 3 else 1)
    return base + weights, grads, optimizer


# Activation elements per token one layer stores for backward, as coefficients of
# (h replicated over tp unless sequence parallel, h split over tp, this rank's KV width, I split over tp).
STORED = {
    # RMSNorm input, normalised tensor and output, twice; Q and attention output; K, V; gate, silu, up, product
    "meshlm": (6, 2, 2, 4),
    # fused RMSNorm keeps its input, the next matmul its output, twice; fused SwiGLU keeps gate and up, the
    # down projection its input (Korthikanti et al. 2022's accounting, with SwiGLU for GeLU)
    "megatron": (4, 2, 2, 3),
}


def stored_per_token(runtime: Runtime, recompute: Recompute) -> tuple[float, float, float, float]:
    """`STORED` under a recompute policy other than full. 'mlp' reruns the second RMSNorm and the SwiGLU from
    the block's mid-point: the layer keeps the first norm's half of the norm term and the attention terms,
    plus the mid-point itself (h), and none of the MLP's."""
    norms, q_out, kv_width, mlp = STORED[runtime]
    if recompute == "mlp":
        return norms / 2 + 1, q_out, kv_width, 0
    return norms, q_out, kv_width, mlp


def layer_activation_bytes(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: Recompute,
    precision: Precision,
    flash: bool = True,
    runtime: Runtime = "meshlm",
    cp: int = 1,
) -> float:
    """Bytes one layer stores for backward for one micro-batch (Korthikanti et al. 2022, adapted to
    Llama: RMSNorm, GQA, SwiGLU, no dropout), per token in activation elements (`STORED`), plus the softmax
    probabilities a·s/tp, only without flash attention and without selective recompute.
    Full recompute keeps only the layer input: h (/tp with sequence parallel); 'mlp' see `stored_per_token`.
    Under context parallel a rank holds seq_len/cp tokens of each sequence and stores the same per token
    (ring attention runs each block through SDPA's fused kernels and saves q, k, v, output and log-sum-exp,
    like flash attention; Ulysses runs SDPA on seq_len tokens of heads/cp), so every term falls as 1/cp, and
    no probabilities are stored whatever `flash` says of the model's own attention (cp replaces it)."""
    h = model.dim
    shard = tp if sp else 1
    tokens = seq_len * micro_batch / cp
    act = BYTES[precision][3]
    if recompute == "full":
        return tokens * h / shard * act
    kv = max(model.n_kv_heads // tp, 1) * model.head_dim
    norms, q_out, kv_width, mlp = stored_per_token(runtime, recompute)
    per_token = norms * h / shard + q_out * h / tp + kv_width * kv + mlp * model.intermediate_size / tp
    if not flash and cp == 1 and recompute in ("none", "mlp"):
        per_token += model.n_heads / tp * seq_len
    return tokens * per_token * act


def logits_bytes(w: Workload, strategy: Candidate, fused: bool = False) -> float:
    """The last stage's loss buffers: what one micro-batch keeps for backward (all m under GPipe) and what its
    loss holds while it runs. Unfused: logits in the activation dtype and their fp32 copy (bf16 only), the
    fp32 log-softmax kept. Fused (train.fused_loss, meshlm.parallel.transforms.fused_loss): no logits kept, but the
    gradients it computes in forward, the hidden states' (activation dtype) and the vocabulary slice's weight
    gradient (fp32, vocab/tp × h), and while it runs one chunk of fp32 logits and their gradient."""
    act = BYTES[w.precision][3]
    saved = strategy.micro_batches(w.global_batch) if strategy.schedule == "gpipe" and strategy.pp > 1 else 1
    tokens = w.seq_len / strategy.cp * strategy.micro_batch
    vocab = w.model.vocab_size / strategy.tp
    if fused:
        return saved * (tokens * act + vocab * 4) * w.model.dim + loss_chunk_bytes(w, strategy)
    return tokens * vocab * (act + (4 if act < 4 else 0) + 4 * saved)


def loss_chunk_bytes(w: Workload, strategy: Candidate) -> float:
    """What the fused loss holds only while it runs (not kept for backward): one chunk's fp32 logits and their
    gradient in the activation dtype."""
    tokens = w.seq_len / strategy.cp * strategy.micro_batch
    vocab = w.model.vocab_size / strategy.tp
    return min(tokens, max(1, LOSS_CHUNK_BYTES // (4 * vocab))) * vocab * (4 + BYTES[w.precision][3])


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the fullest pipeline stage, by part."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float  # ZeRO-3 gathered layers, one recomputed layer, ring attention's working set
    overhead: float
    stage: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.buffers + self.overhead

    def parts_gb(self) -> dict[str, float]:
        parts = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "total")
        return {name: getattr(self, name) / GB for name in parts}


def memory(w: Workload, strategy: Candidate, hw: Hardware, a: Assumptions = DEFAULTS) -> Memory:
    """Peak memory per device: the maximum over pipeline stages. An MoE model's stages hold their dense and
    expert parameters apart (`moe_stage_params`, `moe_state_bytes`) and a mixture of dense and MoE
    layer-activations (`moe_layer_activation_bytes`). The parts that many strategies share are computed once
    each (`stage_states`, `activation_kinds`)."""
    model, s = w.model, strategy
    m = s.micro_batches(w.global_batch)
    kinds, full_layer = activation_kinds(
        model,
        w.seq_len,
        s.micro_batch,
        s.tp,
        s.sequence_parallel,
        s.recompute,
        w.precision,
        a.flash_attention,
        a.runtime,
        s.cp,
    )
    per_layer = kinds[0][1]
    per_moe_layer = kinds[1][1] if model.n_experts else 0.0
    # backward re-runs one layer (or its recomputed part) at a time: those activations are live meanwhile
    buffers = 0.0
    if s.recompute == "full" or s.recompute_layers:
        buffers += max(unrecomputed for unrecomputed, _ in kinds)
    elif s.recompute == "mlp":
        buffers += max(unrecomputed - stored for unrecomputed, stored in kinds)
    if s.zero == 3:  # current and prefetched layer
        buffers += zero3_buffer(w, s)
    buffers += ring_buffer(w, s)
    fixed = hw.framework_bytes if a.overhead_gb is None else a.overhead_gb * GB
    worst, worst_total = None, 0.0
    for i, layers, moe, chunks, (params, grads, optimizer) in stage_states(
        model, w.precision, w.lora_rank, s.mesh, s.zero, s.virtual_stages, a.runtime, s.options.grad_accum_dtype
    ):
        mean_layer = (per_layer * (layers - moe) + per_moe_layer * moe) / layers if layers else per_layer
        if s.recompute_layers:
            args = (s.schedule, s.pp, m, s.virtual_stages, i, chunks, s.recompute_layers, full_layer, mean_layer)
            activations = recomputed_activations(*args)
        else:
            activations = held_layers(s.schedule, s.pp, m, s.virtual_stages, i, chunks) * mean_layer
        logits = logits_bytes(w, s, a.fused) if i == s.pp - 1 else 0.0
        rest = params + grads + optimizer + activations + logits + buffers
        overhead = fixed + a.overhead_fraction * rest
        total = params + grads + optimizer + activations + logits + buffers + overhead  # Memory.total, unbuilt
        if worst is None or total > worst_total:
            worst, worst_total = (params, grads, optimizer, activations, logits, buffers, overhead, i), total
    return Memory(*worst)


def memory_key(s: Candidate) -> Candidate:
    """`s` as far as `memory` can tell: strategies with the same key have the same memory. Its only field that
    no memory term reads without cp is cp_attention; under cp ring and Ulysses attention store the same bytes
    per token (`layer_activation_bytes`) but only the ring holds `ring_buffer`."""
    return s if s.cp_attention == "ring" or s.cp > 1 else s.with_options(cp_attention="ring")


def ring_buffer(w: Workload, s: Candidate) -> float:
    """What ring attention (meshlm.parallel.cp.attention) holds only while one layer's attention backward runs,
    its largest working set (forward holds less: one K/V block in flight and the fp32 output): the K/V block
    in hand and the one in flight (2 × 2·t·kv, activation dtype); the K/V-gradient accumulator in hand and the
    one in flight (2 × 2·t·kv, fp32 or wider); the query gradient's fp32 accumulator (t·q); and one block's
    gradients from the kernel (t·q + 2·t·kv, activation dtype), for the t = seq_len·micro_batch/cp tokens of
    the rank, q = n_heads·head_dim/tp and kv = n_kv_heads·head_dim/tp wide. The kernels keep no score block.
    0 without cp, and under Ulysses (its all-to-all buffers are the size of the activations it saves)."""
    if s.cp == 1 or s.cp_attention != "ring":
        return 0.0
    model, act = w.model, BYTES[w.precision][3]
    tokens = w.seq_len * s.micro_batch / s.cp
    q = max(model.n_heads // s.tp, 1) * model.head_dim
    kv = max(model.n_kv_heads // s.tp, 1) * model.head_dim
    wide = max(act, 4)
    return tokens * (4 * kv * act + 4 * kv * wide + q * wide + (q + 2 * kv) * act)


def zero3_buffer(w: Workload, s: Candidate) -> float:
    """ZeRO-3's gathered weights: the current and the prefetched layer (the larger of a dense and an MoE one)."""
    model = w.model
    return 2 * max(layer_params(model, s.tp), sum(moe_layer_params(model, s.tp, s.ep))) * BYTES[w.precision][0]


def memory_floor(w: Workload, strategy: Candidate, hw: Hardware, a: Assumptions = DEFAULTS) -> float:
    """A lower bound of `memory(...).total` for `strategy` with any `recompute_layers`: the fullest stage without
    its activations and without the buffer of a recomputed layer. Every term left out is ≥ 0 and a rounded
    sum never falls when a term grows, so no `recompute_layers` brings a strategy below its floor."""
    s = strategy
    buffers = ring_buffer(w, s)
    if s.zero == 3:
        buffers += zero3_buffer(w, s)
    fixed = hw.framework_bytes if a.overhead_gb is None else a.overhead_gb * GB
    floor = 0.0
    for i, _, _, _, (params, grads, optimizer) in stage_states(
        w.model, w.precision, w.lora_rank, s.mesh, s.zero, s.virtual_stages, a.runtime, s.options.grad_accum_dtype
    ):
        logits = logits_bytes(w, s, a.fused) if i == s.pp - 1 else 0.0
        rest = params + grads + optimizer + logits + buffers
        floor = max(floor, params + grads + optimizer + logits + buffers + (fixed + a.overhead_fraction * rest))
    return floor


@lru_cache(maxsize=4096)
def stage_states(
    model: ModelConfig,
    precision: Precision,
    lora_rank: int,
    mesh: Layout,
    zero: int,
    virtual_stages: int,
    runtime: Runtime,
    grad_accum_dtype: str = "fp32",
) -> tuple[tuple[int, int, int, tuple[int, ...], tuple[float, float, float]], ...]:
    """Per representative pipeline stage (`representative_stages`): (stage, its layers, of them MoE, its chunks'
    layers, (weights, gradients, optimizer) bytes). What `memory` needs that no per-micro-batch choice
    changes."""
    s = Candidate(mesh, ParallelOptions(zero=zero, virtual_stages=virtual_stages, grad_accum_dtype=grad_accum_dtype))
    chunks = rank_chunks(model, s.pp, virtual_stages, runtime)
    moe = rank_moe_layers(model, s.pp, virtual_stages, runtime)
    out = []
    for i in representative_stages(chunks):
        layers = sum(chunks[i])
        psi = stage_params(model, s.tp, layers, i == 0, i == s.pp - 1)
        if lora_rank:
            psi_lora = layers * layer_lora_params(model, s.tp, lora_rank)
            states = lora_state_bytes(psi, psi_lora, s.replicas, s.zero, precision, grad_accum_dtype)
        elif model.n_experts:
            dense, experts = moe_stage_params(model, s.tp, s.ep, layers, moe[i], i == 0, i == s.pp - 1)
            states = moe_state_bytes(dense, experts, s, precision, runtime)
        else:
            states = model_state_bytes(psi, s.replicas, s.zero, precision, runtime, grad_accum_dtype)
        out.append((i, layers, moe[i], chunks[i], states))
    return tuple(out)


@lru_cache(maxsize=4096)
def activation_kinds(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: Recompute,
    precision: Precision,
    flash: bool,
    runtime: Runtime,
    cp: int,
) -> tuple[tuple[tuple[float, float], ...], float]:
    """What one layer stores for backward for one micro-batch: ((bytes without recompute, bytes under
    `recompute`) of a dense layer, then of an MoE layer for MoE models), and a dense layer's bytes under full
    recompute."""
    args = (model, seq_len, micro_batch, tp, sp)
    none = layer_activation_bytes(*args, "none", precision, flash, runtime, cp)
    kinds = [(none, layer_activation_bytes(*args, recompute, precision, flash, runtime, cp))]
    if model.n_experts:
        moe_none = moe_layer_activation_bytes(*args, "none", precision, flash, runtime, cp)
        kinds.append((moe_none, moe_layer_activation_bytes(*args, recompute, precision, flash, runtime, cp)))
    return tuple(kinds), layer_activation_bytes(*args, "full", precision, flash, runtime, cp)


# ---- mixture of experts (meshlm.model.moe, meshlm.parallel.ep.experts; docs/planner.md) -----------------


@lru_cache(maxsize=4096)
def rank_moe_layers(model: ModelConfig, pp: int, virtual_stages: int = 1, runtime: Runtime = "meshlm") -> tuple:
    """MoE layers each pipeline rank holds (all 0 for a dense model): of the runtime's contiguous chunks
    (`chunk_layers`), rank i holds chunks i, i+pp, ...; `model.moe_layers` says which layers are MoE."""
    if not model.n_experts:
        return (0,) * pp
    chunks = chunk_layers(model, pp * virtual_stages, runtime)
    moe = set(model.moe_layers)
    starts = itertools.accumulate(chunks, initial=0)
    per_chunk = [len(moe.intersection(range(start, start + n))) for start, n in zip(starts, chunks, strict=False)]
    return tuple(sum(per_chunk[i::pp]) for i in range(pp))


@lru_cache(maxsize=1024)
def moe_layer_params(model: ModelConfig, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of one MoE layer on one rank. Dense: attention and norms as a dense layer's
    (`layer_params` less its SwiGLU), the router (d·E) and the shared expert's gate replicated, the shared
    expert split over tp like a dense SwiGLU. Expert: E/ep routed experts of 3·d·moe_intermediate_size each,
    split over tp as well (Megatron's expert tensor parallelism: each expert's hidden width over tp)."""
    d = model.dim
    mlp = 3 * d * model.intermediate_size // tp
    shared = 3 * d * model.shared_expert_intermediate_size // tp + (d if model.shared_expert_gate else 0)
    dense = layer_params(model, tp) - mlp + d * model.n_experts + shared
    return dense, model.n_experts // ep * 3 * d * model.moe_intermediate_size / tp


def moe_stage_params(
    model: ModelConfig, tp: int, ep: int, layers: int, moe_layers: int, first: bool, last: bool
) -> tuple[float, float]:
    """(dense, expert) Ψ of one rank holding `layers` layers of which `moe_layers` are MoE: `stage_params`
    with each MoE layer's SwiGLU replaced by its router, shared expert and E/ep experts (`moe_layer_params`),
    plus Qwen3's q/k norms (2·head_dim per layer, replicated). At tp = pp = ep = 1 the two sum to
    `param_counts(cfg)["total"]`."""
    dense_moe, experts = moe_layer_params(model, tp, ep)
    dense = stage_params(model, tp, layers, first, last) + moe_layers * (dense_moe - layer_params(model, tp))
    dense += layers * (2 * model.head_dim if model.qk_norm else 0)
    return dense, moe_layers * experts


def moe_state_bytes(
    dense: float, experts: float, s: Candidate, precision: Precision, runtime: Runtime = "meshlm"
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of a rank holding `dense` and `experts` parameters: data
    parallel reduces (and ZeRO shards) the dense ones over all data replicas dp × ep × cp and the expert shards
    over the ranks holding the same experts, dp × cp (meshlm.parallel.dp.data_parallel: a flat buffer per kind,
    each with its own group)."""
    accum = s.options.grad_accum_dtype
    dense_bytes = model_state_bytes(dense, s.replicas, s.zero, precision, runtime, accum)
    expert_bytes = model_state_bytes(experts, s.expert_replicas, s.zero, precision, runtime, accum)
    return tuple(a + b for a, b in zip(dense_bytes, expert_bytes, strict=True))


def moe_layer_activation_bytes(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: Recompute,
    precision: Precision,
    flash: bool = True,
    runtime: Runtime = "meshlm",
    cp: int = 1,
) -> float:
    """Bytes one MoE layer stores for backward for one micro-batch (0 for a dense model). Each token is
    k rows through the routed experts' SwiGLU (moe_intermediate_size wide) and one through the shared expert,
    so the layer stores what a dense layer of SwiGLU width k·moe_intermediate_size + shared width stores
    (`layer_activation_bytes`: the rows a rank's experts receive from every ep rank are, balanced, k per
    local token), plus the dispatch: the experts' permuted input rows and their outputs before the weighted
    combine (2·k·h per token), and the router's fp32 logits and scores (2·E·4 bytes per token). Full
    recompute keeps only the layer input, as a dense layer; 'mlp' recompute stores what a dense layer does."""
    if not model.n_experts:
        return 0.0
    width = model.top_k * model.moe_intermediate_size + model.shared_expert_intermediate_size
    args = (seq_len, micro_batch, tp, sp, recompute, precision, flash, runtime, cp)
    layer = layer_activation_bytes(model.replace(intermediate_size=width), *args)
    if recompute in ("full", "mlp"):  # the routing and dispatch sit in the recomputed MLP half
        return layer
    tokens = seq_len * micro_batch / cp
    return layer + tokens * (2 * model.top_k * model.dim * BYTES[precision][3] + 2 * model.n_experts * 4)
