"""Context parallel's size rules and its Strategy (imports no torch). Its plan rules and mechanics are
meshlm.parallel.cp.attention (ring and Ulysses attention, the load-balanced sequence split), its run-time hook
meshlm.parallel.cp.hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.model.config import ModelConfig
from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


def check_context_parallel(
    cfg: ModelConfig, cp: int, tp: int, seq_len: int, attention: str, sequence_parallel: bool = False
) -> None:
    """Raise a one-line LayoutError if the sequence (ring) or the heads (Ulysses) do not split over cp.
    The ring's causal load balancing cuts each sequence into 2·cp chunks; Ulysses trades the sequence
    shard for cp-th of each rank's (tp-local) heads, query and key/value alike."""
    if cp == 1:
        return
    if attention not in ("ring", "ulysses"):
        raise LayoutError(f"parallel.cp_attention = {attention!r}; valid: 'ring', 'ulysses'")
    if cfg.sliding_window:
        raise LayoutError(f"context parallel (cp={cp}) needs full causal attention, not model.sliding_window")
    if seq_len and seq_len % (2 * cp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by 2·cp = {2 * cp} (load-balanced chunks)")
    if sequence_parallel and seq_len and seq_len % (cp * tp):
        raise LayoutError(f"data.seq_len ({seq_len}) is not divisible by cp×tp = {cp * tp} under sequence_parallel")
    if attention == "ulysses":
        for name in ("n_heads", "n_kv_heads"):
            if getattr(cfg, name) % (cp * tp):
                raise LayoutError(
                    f"model.{name} ({getattr(cfg, name)}) is not divisible by cp×tp = {cp * tp}, "
                    f"needed by parallel.cp_attention = 'ulysses' (use 'ring')"
                )


class ContextParallel:
    """meshlm.parallel.cp.attention: each rank holds part of every sequence; ring or Ulysses attention."""

    dim = "cp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.cp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        lay, options = spec.layout, spec.options
        if spec.model is not None:
            check_context_parallel(
                spec.model, lay.cp, lay.tp, spec.seq_len, options.cp_attention, options.sequence_parallel
            )

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.cp.attention import check_cp_plan

        check_cp_plan(model, plan)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.cp.attention import apply_context_parallel
        from meshlm.parallel.cp.hooks import ContextParallelHooks

        apply_context_parallel(build.model, build.plan, build.mesh.group("cp"), build.options.cp_attention)
        return ContextParallelHooks(build.mesh)
