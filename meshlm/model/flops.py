"""Parameter and FLOP counts as pure functions of the model shape (used by MFU and the planner)."""

from __future__ import annotations

from meshlm.model.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by part; `total` matches `sum(p.numel())` of the built model and `active` counts
    what one token uses (an MoE layer's router, shared expert and top_k of its n_experts routed experts).
    `per_layer` is a dense layer's count; `layers` sums every layer, dense and MoE."""
    d, h = cfg.dim, cfg.head_dim
    qkv_bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * h if cfg.qkv_bias else 0
    attn = d * (cfg.n_heads * h) + 2 * d * (cfg.n_kv_heads * h) + (cfg.n_heads * h) * d + qkv_bias
    norms = 2 * d + (2 * h if cfg.qk_norm else 0)
    mlp = 3 * d * cfg.intermediate_size
    expert = 3 * d * cfg.moe_intermediate_size
    shared = 3 * d * cfg.shared_expert_intermediate_size + (d if cfg.shared_expert_gate else 0)
    router = d * cfg.n_experts
    n_moe = len(cfg.moe_layers)
    moe_total = router + cfg.n_experts * expert + shared if n_moe else 0
    moe_active = router + cfg.top_k * expert + shared if n_moe else 0
    layers = cfg.n_layers * (attn + norms) + (cfg.n_layers - n_moe) * mlp + n_moe * moe_total
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + layers + d + head
    return {
        "embedding": embedding,
        "per_layer": attn + norms + mlp,
        "layers": layers,
        "attention_per_layer": attn,
        "qkv_bias_per_layer": qkv_bias,
        "mlp_per_layer": mlp,
        "moe_layers": n_moe,
        "expert_per_layer": expert,
        "moe_per_layer": moe_total,
        "moe_active_per_layer": moe_active,
        "final_norm": d,
        "lm_head": head,
        "total": total,
        "active": total - n_moe * (moe_total - moe_active),
    }


def _matmul_per_layer(cfg: ModelConfig) -> float:
    """Matmul weights one token multiplies by in the mean layer: attention projections (not their biases) and
    a dense MLP, or an MoE layer's router, top_k experts, shared expert and its gate."""
    c = param_counts(cfg)
    n_moe = c["moe_layers"]
    mlps = (cfg.n_layers - n_moe) * c["mlp_per_layer"] + n_moe * c["moe_active_per_layer"]
    return c["attention_per_layer"] - c["qkv_bias_per_layer"] + mlps / cfg.n_layers


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's projection matrices (not their
    biases; of an MoE layer the active ones) and the output head."""
    return round(cfg.n_layers * _matmul_per_layer(cfg)) + cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: 2 per matmul weight forward, plus attention scores and weighted sum.

    Forward: 2·N_matmul + 4·L·s·n_heads·head_dim (QKᵀ and AV over the full s×s square, the PaLM / Megatron
    convention, no causal discount; n_heads·head_dim = d unless head_dim is set apart). N_matmul counts an MoE
    layer's *active* weights (router, top_k experts, shared expert), so MFU is by active parameters; the
    elementwise routing work (softmax, top-k, weighting) is not counted, like norms and activations. Training
    (forward + backward) is 3× the forward. Recomputation is not counted: this is *model* FLOPs, the
    numerator of MFU.
    """
    forward = 2 * matmul_params(cfg) + 4 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return float(3 * forward if training else forward)


def part_costs(cfg: ModelConfig, cost: str = "flops", seq_len: int | None = None) -> tuple[float, float, float]:
    """(embedding, one layer, final norm + head) cost, by forward FLOPs per token or by parameter count.

    FLOPs balance step time (the embedding is a lookup, the head a V×d matmul); parameters balance memory.
    Layers that differ (dense and MoE) count as their mean: the split balances stages of many layers.
    """
    counts = param_counts(cfg)
    if cost == "params":
        layer = counts["layers"] / cfg.n_layers
        return float(counts["embedding"]), layer, float(counts["final_norm"] + counts["lm_head"])
    if cost == "flops":
        s = seq_len or cfg.max_seq_len
        return 0.0, 2.0 * _matmul_per_layer(cfg) + 4.0 * s * cfg.n_heads * cfg.head_dim, 2.0 * cfg.vocab_size * cfg.dim
    raise ValueError(f"pipeline split cost must be 'flops' or 'params', got {cost!r}")
