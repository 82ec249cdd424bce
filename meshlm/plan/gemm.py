"""GEMM time by shape on a GPU of the table: the matmuls one layer (and the head) runs for a micro-batch, each
priced as a kernel of its own shape, and how far below a large, well-shaped GEMM's rate they run together.

A kernel of m×n×k (batch b) costs a fixed time plus the larger of its FLOPs at the device's maximum achievable
matmul rate and its bf16 operands and result at the achievable memory bandwidth:

    t = KERNEL_OVERHEAD_S + max(2·b·m·n·k / matmul_max, 2·b·(m·k + k·n + m·n) / (0.8 · HBM bandwidth))

`matmul_max` is the published maximum achievable matmul FLOP/s of the device (`Hardware.matmul_max`);
KERNEL_OVERHEAD_S is fitted to XLA's published H100 GEMM measurements (docs/planner.md, "GEMM rates by shape").
Forward, input-gradient and weight-gradient GEMMs of one matmul have the same FLOPs and (in this model) the
same bytes, so the forward's shapes stand for all three. Formulas and sources: docs/planner.md.
"""

from __future__ import annotations

from functools import lru_cache

from meshlm.model.config import ModelConfig
from meshlm.plan.hardware import Hardware
from meshlm.plan.pipeline_split import Runtime

# Fixed seconds of one GEMM kernel (prologue, the last wave's tail, epilogue, launch): with matmul_max =
# 794.5 TFLOP/s the least-squares fit to the first 72 sm_90 bf16 entries of XLA's table (m, n, k 256–4096,
# batch 1–4) is 6.0 µs, log-rms error 9.5 %.
KERNEL_OVERHEAD_S = 6e-6
MEMORY_EFFICIENCY = 0.8  # achievable fraction of HBM bandwidth: GEMMs here, streaming elementwise kernels in step_time
OPERAND_BYTES = 2  # bf16 operands and result


def gemm_seconds(m: float, n: float, k: float, hw: Hardware, batch: float = 1.0) -> float:
    """Seconds of one (batched) GEMM kernel of m×n×k on `hw`, which must have a `matmul_max`."""
    if hw.matmul_max is None:
        raise ValueError(f"{hw.name} has no published matmul_max to price GEMMs by shape")
    flops = 2.0 * batch * m * n * k
    nbytes = OPERAND_BYTES * batch * (m * k + k * n + m * n)
    return KERNEL_OVERHEAD_S + max(flops / hw.matmul_max, nbytes / (hw.memory_bw * MEMORY_EFFICIENCY))


Gemm = tuple[float, float, float, float, float]  # (weight: kernels per mean layer, m, n, k, batch)


def dense_gemms(model: ModelConfig, tokens: float, tp: int, runtime: Runtime) -> list[Gemm]:
    """The forward GEMMs of a dense layer on one tensor-parallel rank for `tokens` rows: the attention
    projections and the SwiGLU MLP, column-parallel ones split on n, row-parallel ones on k. meshlm's
    layer (meshlm.model.llama) runs q, k, v, o, gate, up and down as seven nn.Linear; Megatron fuses q, k, v
    into one GEMM and gate and up into one."""
    h, q = model.dim, model.n_heads * model.head_dim / tp
    kv, i = max(model.n_kv_heads // tp, 1) * model.head_dim, model.intermediate_size / tp
    if runtime == "megatron":
        return [(1, tokens, q + 2 * kv, h, 1), (1, tokens, h, q, 1), (1, tokens, 2 * i, h, 1), (1, tokens, h, i, 1)]
    projections = [(1, tokens, q, h, 1), (2, tokens, kv, h, 1), (1, tokens, h, q, 1)]
    return [*projections, (2, tokens, i, h, 1), (1, tokens, h, i, 1)]


def moe_gemms(model: ModelConfig, tokens: float, tp: int, ep: int, runtime: Runtime, rows: float = 1.0) -> list[Gemm]:
    """The forward GEMMs of an MoE layer's MLP on one rank: the router (n = E), the shared expert (a dense
    SwiGLU of its width, split over tp) and the routed experts as grouped GEMMs, one kernel for the E/ep
    local experts (torch._grouped_mm in meshlm.model.moe; Megatron's grouped GEMM fusing gate and up), each
    expert's rows k·tokens·ep/E under balanced routing (every rank of the ep group sends each expert
    k·tokens/E rows; each tp rank runs the gathered rows on its tp-th of the hidden units); `rows` of them
    under a capacity factor (`Assumptions.moe_rows`)."""
    h, local = model.dim, model.n_experts / ep
    rows, i = rows * tokens * model.top_k * ep / model.n_experts, model.moe_intermediate_size / tp
    gemms: list[Gemm] = [(1, tokens, model.n_experts, h, 1)]
    if model.shared_expert_intermediate_size:
        shared = model.shared_expert_intermediate_size / tp
        gemms += [(2, tokens, shared, h, 1), (1, tokens, h, shared, 1)]
    up = [(1, rows, 2 * i, h, local)] if runtime == "megatron" else [(2, rows, i, h, local)]
    return [*gemms, *up, (1, rows, h, i, local)]


def attention_gemms(model: ModelConfig, tokens: float, tp: int, runtime: Runtime) -> list[Gemm]:
    """`dense_gemms` less its MLP: the attention projections an MoE layer runs beside its experts."""
    return dense_gemms(model, tokens, tp, runtime)[: 2 if runtime == "megatron" else 3]


def _efficiency(gemms: list[Gemm], hw: Hardware) -> float:
    """The GEMMs' FLOPs at matmul_max over their kernel time: their rate as a fraction of a large one's."""
    flops = sum(w * 2.0 * b * m * n * k for w, m, n, k, b in gemms)
    seconds = sum(w * gemm_seconds(m, n, k, hw, b) for w, m, n, k, b in gemms)
    return flops / hw.matmul_max / seconds


@lru_cache(maxsize=4096)
def shape_efficiency(
    model: ModelConfig, tokens: float, tp: int, ep: int, runtime: Runtime, hw: Hardware, rows: float = 1.0
) -> tuple[float, float]:
    """(the mean layer's GEMMs, the head's GEMM) as a fraction of a large, well-shaped GEMM's rate, for a
    micro-batch of `tokens` rows on one rank. 1.0 on a device without a published `matmul_max` (cpu, a GPU
    known only by its calibration) or with a measured matmul rate: those rates are taken as they are."""
    if hw.matmul_max is None or hw.matmul_flops is not None or tokens <= 0:
        return 1.0, 1.0
    n_moe = len(model.moe_layers)
    dense = [(w * (model.n_layers - n_moe), *g) for w, *g in dense_gemms(model, tokens, tp, runtime)]
    moe = attention_gemms(model, tokens, tp, runtime) + moe_gemms(model, tokens, tp, ep, runtime, rows) if n_moe else []
    layer = dense + [(w * n_moe, *g) for w, *g in moe]
    head = [(1.0, tokens, model.vocab_size / tp, model.dim, 1.0)]
    return _efficiency(layer, hw), _efficiency(head, hw)
