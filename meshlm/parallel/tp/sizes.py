"""Tensor parallel's size rules (imports no torch). A module of their own, below tp's Strategy: the built-in
plans (meshlm.parallel.plan_registry) check meshlm's model with them, and the Strategy's model check reads the
plan registry, so living in strategy.py would close an import circle."""

from __future__ import annotations

from meshlm.model.config import ModelConfig
from meshlm.parallel.mesh import LayoutError


def check_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Raise a one-line LayoutError if the model (or, under SP, the sequence) does not split over tp.
    Needs no process group: call it while validating the config."""
    if tp == 1:
        return
    moe = ("moe_intermediate_size", "shared_expert_intermediate_size") if cfg.n_experts else ()
    for name in ("n_heads", "intermediate_size", "vocab_size", *moe):
        if getattr(cfg, name) % tp:
            raise LayoutError(f"model.{name} ({getattr(cfg, name)}) is not divisible by tp={tp}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise LayoutError(
            f"model.n_kv_heads ({cfg.n_kv_heads}) must divide or be divisible by tp={tp} (KV heads split or replicated)"
        )
    if sequence_parallel and seq_len % tp:
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by tp={tp}, needed by parallel.sequence_parallel")
