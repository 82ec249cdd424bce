"""Memory per device of one layout: model states by ZeRO stage, activations by recompute policy and
pipeline schedule, the loss's logits, transient buffers, and framework overhead.

Every formula and its source is in docs/planner.md; the code follows the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from meshlm.model.config import ModelConfig
from meshlm.plan.hardware import GB, Hardware

Precision = Literal["bf16", "fp32"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]

# Bytes per parameter of (weights, gradients, optimizer state) and per stored activation element.
# bf16: mixed-precision Adam as in the ZeRO paper (2Ψ + 2Ψ + 12Ψ: fp32 master, m, v).
# fp32: what meshlm runs on CPU (4Ψ + 4Ψ + 8Ψ: fp32 m, v; the weights are the master copy).
BYTES: dict[str, tuple[int, int, int, int]] = {"bf16": (2, 2, 12, 2), "fp32": (4, 4, 8, 4)}


@dataclass(frozen=True)
class Workload:
    """What to train: a model shape, sequences of seq_len tokens, global_batch sequences per step."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    train_tokens: float
    precision: Precision = "bf16"
    name: str = "model"


@dataclass(frozen=True)
class Layout:
    """One way to run a workload: the mesh (pp outer, dp, tp inner) and every per-rank choice."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    zero: int = 0
    micro_batch: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def mesh(self) -> str:
        """The `parallel.layout` string, e.g. 'pp=2,dp=4,tp=8'."""
        return f"pp={self.pp},dp={self.dp},tp={self.tp}"

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def overrides(self) -> dict[str, object]:
        """The meshlm config fields (`section.field`) that select this layout in the trainer."""
        return {
            "parallel.layout": self.mesh,
            "parallel.zero": self.zero,
            "parallel.schedule": self.schedule,
            "parallel.virtual_stages": self.virtual_stages,
            "parallel.sequence_parallel": self.sequence_parallel,
            "train.micro_batch": self.micro_batch,
            "train.activation_checkpointing": self.recompute == "full",
        }

    def __str__(self) -> str:
        sched = f"{self.schedule}×{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        sp = " sp" if self.sequence_parallel else ""
        return f"{self.mesh} zero={self.zero} mb={self.micro_batch} {sched} recompute={self.recompute}{sp}"


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the model that are not hardware figures; defaults and their reasons in docs/planner.md."""

    flash_attention: bool = True  # SDPA flash / memory-efficient kernels: no s² attention matrix stored
    overhead_gb: float | None = None  # fixed per-device overhead; None: the device's framework_bytes
    overhead_fraction: float = 0.05  # allocator fragmentation, as a fraction of everything else
    compute_efficiency: float | None = None  # None: 0.5 of peak, or 0.8 of a measured matmul rate
    dp_overlap: float | None = None  # fraction of backward that hides DP communication; None: 0.8, cpu 0
    tp_overlap: float = 0.0  # fraction of tensor-parallel communication hidden behind compute
    bucket_mb: float = 25.0  # last gradient bucket, never hidden


DEFAULTS = Assumptions()


def chunk_layers(n_layers: int, chunks: int) -> list[int]:
    """Layers per model chunk, as even as possible. The remainder goes to the middle chunks, so the first
    (embedding) and last (head and loss) chunks get fewer: the Llama 3 recipe (Dubey et al. 2024, §3.3.2)."""
    base, extra = divmod(n_layers, chunks)
    order = [*range(1, chunks - 1), 0, chunks - 1] if chunks > 2 else list(range(chunks))
    counts = [base] * chunks
    for c in order[:extra]:
        counts[c] += 1
    return counts


@lru_cache(maxsize=4096)
def stage_layers(n_layers: int, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Layers each pipeline rank holds; with v virtual stages rank i holds chunks i, i+pp, i+2pp, ..."""
    chunks = chunk_layers(n_layers, pp * virtual_stages)
    return tuple(sum(chunks[i::pp]) for i in range(pp))


@lru_cache(maxsize=4096)
def representative_stages(layers: tuple[int, ...]) -> tuple[int, ...]:
    """Stages worth evaluating: first, last, and the first of each run of equal layer counts. Every
    schedule keeps the most micro-batches in flight on the earliest stage, so these hold the maxima."""
    return tuple(i for i in range(len(layers)) if i in (0, 1, len(layers) - 1) or layers[i] != layers[i - 1])


@lru_cache(maxsize=1024)
def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one layer on one tensor-parallel rank. KV heads are split over tp when there are
    enough of them, else replicated so each rank holds one (needs tp % n_kv_heads == 0)."""
    d, hd = model.dim, model.head_dim
    kv_heads = max(model.n_kv_heads // tp, 1)
    attention = 2 * d * model.n_heads * hd // tp + 2 * d * kv_heads * hd
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


def model_state_bytes(psi: float, dp: int, zero: int, precision: Precision) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes: stage 1 shards the optimizer over dp, 2 also the gradients,
    3 also the weights (Rajbhandari et al. 2020)."""
    w, g, o, _ = BYTES[precision]
    return (
        w * psi / (dp if zero >= 3 else 1),
        g * psi / (dp if zero >= 2 else 1),
        o * psi / (dp if zero >= 1 else 1),
    )


def layer_activation_bytes(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: Recompute,
    precision: Precision,
    flash: bool = True,
) -> float:
    """Bytes one layer stores for backward for one micro-batch (Korthikanti et al. 2022, adapted to
    Llama: RMSNorm, GQA, SwiGLU, no dropout). Per token, in activation elements:
      norms and their outputs: 2 × (input, normalised, output) = 6h   (/tp with sequence parallel)
      attention: Q and output 2h/tp, K and V 2·kv (kv = this rank's KV heads × head_dim)
      SwiGLU: gate, silu(gate), up, product = 4·I/tp
      softmax probabilities a·s/tp, only without flash attention and without selective recompute
    Full recompute keeps only the layer input: h (/tp with sequence parallel)."""
    h = model.dim
    shard = tp if sp else 1
    tokens = seq_len * micro_batch
    act = BYTES[precision][3]
    if recompute == "full":
        return tokens * h / shard * act
    kv = max(model.n_kv_heads // tp, 1) * model.head_dim
    per_token = 6 * h / shard + 2 * h / tp + 2 * kv + 4 * model.intermediate_size / tp
    if not flash and recompute == "none":
        per_token += model.n_heads / tp * seq_len
    return tokens * per_token * act


def in_flight(schedule: Schedule, pp: int, micro_batches: int, virtual_stages: int, stage: int) -> float:
    """Micro-batches whose activations `stage` holds at its peak, in units of all of its layers.
    GPipe keeps all m; 1F1B keeps pp − stage (Narayanan et al. 2021); interleaved keeps
    2(pp − stage − 1) + (v − 1)·pp + 1 chunks of 1/v of the layers (Megatron-LM's warm-up count)."""
    m, v = micro_batches, virtual_stages
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - stage, m)
    return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v) / v


def logits_bytes(w: Workload, layout: Layout) -> float:
    """The last stage's loss buffers for one micro-batch: logits in the activation dtype, their fp32 copy
    (bf16 only) and the fp32 log-softmax kept for backward, the latter for all m under GPipe."""
    act = BYTES[w.precision][3]
    saved = layout.micro_batches(w.global_batch) if layout.schedule == "gpipe" and layout.pp > 1 else 1
    per_element = act + (4 if act < 4 else 0) + 4 * saved
    return w.seq_len * layout.micro_batch * w.model.vocab_size / layout.tp * per_element


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the fullest pipeline stage, by part."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float  # ZeRO-3 gathered layers, one recomputed layer
    overhead: float
    stage: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.buffers + self.overhead

    def parts_gb(self) -> dict[str, float]:
        parts = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "total")
        return {name: getattr(self, name) / GB for name in parts}


def memory(w: Workload, layout: Layout, hw: Hardware, a: Assumptions = DEFAULTS) -> Memory:
    """Peak memory per device: the maximum over pipeline stages."""
    model, lay = w.model, layout
    layers = stage_layers(model.n_layers, lay.pp, lay.virtual_stages)
    m = lay.micro_batches(w.global_batch)
    act_args = (model, w.seq_len, lay.micro_batch, lay.tp, lay.sequence_parallel)
    per_layer = layer_activation_bytes(*act_args, lay.recompute, w.precision, a.flash_attention)
    buffers = 0.0
    if lay.recompute == "full":  # backward re-runs one layer at a time: its full activations are live
        buffers += layer_activation_bytes(*act_args, "none", w.precision, a.flash_attention)
    if lay.zero == 3:
        buffers += 2 * layer_params(model, lay.tp) * BYTES[w.precision][0]  # current and prefetched layer
    fixed = hw.framework_bytes if a.overhead_gb is None else a.overhead_gb * GB
    worst = None
    for s in representative_stages(layers):
        psi = stage_params(model, lay.tp, layers[s], s == 0, s == lay.pp - 1)
        params, grads, optimizer = model_state_bytes(psi, lay.dp, lay.zero, w.precision)
        activations = in_flight(lay.schedule, lay.pp, m, lay.virtual_stages, s) * layers[s] * per_layer
        logits = logits_bytes(w, lay) if s == lay.pp - 1 else 0.0
        rest = params + grads + optimizer + activations + logits + buffers
        mem = Memory(params, grads, optimizer, activations, logits, buffers, fixed + a.overhead_fraction * rest, s)
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst
