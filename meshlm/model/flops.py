"""Parameter and FLOP counts as pure functions of the model shape (used by MFU and the planner)."""

from __future__ import annotations

from meshlm.model.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by part; they match `sum(p.numel())` of the built model."""
    d, h = cfg.dim, cfg.head_dim
    qkv_bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * h if cfg.qkv_bias else 0
    attn = d * (cfg.n_heads * h) + 2 * d * (cfg.n_kv_heads * h) + (cfg.n_heads * h) * d + qkv_bias
    mlp = 3 * d * cfg.intermediate_size
    norms = 2 * d
    per_layer = attn + mlp + norms
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + cfg.n_layers * per_layer + d + head
    return {
        "embedding": embedding,
        "per_layer": per_layer,
        "attention_per_layer": attn,
        "qkv_bias_per_layer": qkv_bias,
        "mlp_per_layer": mlp,
        "final_norm": d,
        "lm_head": head,
        "total": total,
    }


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's projection matrices (not their
    biases) and the output head."""
    c = param_counts(cfg)
    matrices = c["attention_per_layer"] - c["qkv_bias_per_layer"] + c["mlp_per_layer"]
    return cfg.n_layers * matrices + cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: 2 per matmul weight forward, plus attention scores and weighted sum.

    Forward: 2·N_matmul + 4·L·s·n_heads·head_dim (QKᵀ and AV over the full s×s square, the PaLM / Megatron
    convention, no causal discount; n_heads·head_dim = d unless head_dim is set apart). Training (forward +
    backward) is 3× the forward. Recomputation is not counted: this is *model* FLOPs, the numerator of MFU.
    """
    forward = 2 * matmul_params(cfg) + 4 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return float(3 * forward if training else forward)


def part_costs(cfg: ModelConfig, cost: str = "flops", seq_len: int | None = None) -> tuple[float, float, float]:
    """(embedding, one layer, final norm + head) cost, by forward FLOPs per token or by parameter count.

    FLOPs balance step time (the embedding is a lookup, the head a V×d matmul); parameters balance memory.
    """
    counts = param_counts(cfg)
    if cost == "params":
        return float(counts["embedding"]), float(counts["per_layer"]), float(counts["final_norm"] + counts["lm_head"])
    if cost == "flops":
        s = seq_len or cfg.max_seq_len
        matmuls = counts["attention_per_layer"] - counts["qkv_bias_per_layer"] + counts["mlp_per_layer"]
        return 0.0, 2.0 * matmuls + 4.0 * s * cfg.n_heads * cfg.head_dim, 2.0 * cfg.vocab_size * cfg.dim
    raise ValueError(f"pipeline split cost must be 'flops' or 'params', got {cost!r}")
