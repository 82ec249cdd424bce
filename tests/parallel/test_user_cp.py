"""Context parallel for a user's model: the GPT-2-style example (learned positions, its own attention core).

Its plan names the attention core (`attention="h.*.attn.core"`, forward (q, k, v) -> out), which cp replaces
by ring or Ulysses attention, and the learned position embedding (`positions="wpe"`), which under cp gets the
global positions of the rank's load-balanced chunks. At cp=2, with either core, training equals one process
(tests/equivalence.py criterion 1: per-step loss and gradient norm within 1e-5 relative over 10 AdamW steps),
also with tp=2 (the fused c_attn) and with dp=2 under ZeRO-1; without the positions hook it must not. A plan
that names no attention is refused in one line, untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, run_shared
from equivalence import assert_same_losses, criterion_failures, global_batch
from torch import nn

import meshlm
from meshlm.parallel.mesh import build_mesh, parse_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt2 import GPT2, GPT2_PLAN

STEPS, BATCH, SEQ, VOCAB = 10, 4, 16, 128
NO_POSITIONS = meshlm.ParallelPlan(**{**vars(GPT2_PLAN), "positions": ""})


def gpt2() -> nn.Module:
    return GPT2(vocab=VOCAB, dim=32, n_layers=2, n_heads=4, max_len=SEQ)


def run(layout: str, plan: meshlm.ParallelPlan = GPT2_PLAN, **parallel: object) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = build_mesh(parse_layout(layout, world), "cpu")
    torch.manual_seed(0)
    model = meshlm.parallelize(gpt2(), mesh, parallel, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, BATCH, SEQ, VOCAB)
        losses.append(model.forward_backward(model.local_batch(x), model.local_batch(y)).item())
        norms.append(model.clip_grad_norm_(1.0).item())
        model.step(opt)
    return {"losses": losses, "grad_norms": norms}


def _cp2() -> dict:
    return {
        "ring": run("cp=2", cp_attention="ring"),
        "ulysses": run("cp=2", cp_attention="ulysses"),
        "no_positions": run("cp=2", plan=NO_POSITIONS),
    }


def test_user_model_under_cp_matches_one_process() -> None:
    ref = run("")
    for rank, got in enumerate(run_shared(_cp2, 2)):
        for core in ("ring", "ulysses"):
            try:
                assert_same_losses(ref, got[core])
            except AssertionError as e:
                raise AssertionError(f"rank {rank} cp=2 {core}: {e}") from None
        # Sharp: learned positions fed the local 0..n-1 train another model.
        assert "losses" in criterion_failures(ref, got["no_positions"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]


def _world4() -> list[dict]:
    return [run("cp=2,tp=2", cp_attention="ring"), run("dp=2,cp=2", cp_attention="ulysses", zero=1)]


@pytest.mark.slow  # two runs on four fresh ranks: 16 s on the 2-core VM
def test_user_model_under_cp_with_tp_or_dp_matches_one_process() -> None:
    ref = run("")
    for rank, runs in enumerate(run_distributed(_world4, 4)):
        for what, got in zip(("cp=2,tp=2 ring", "dp=2,cp=2 ulysses zero=1"), runs, strict=True):
            try:
                assert_same_losses(ref, got)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} {what}: {e}") from None


def _refused() -> tuple[str, bool]:
    mesh = build_mesh(parse_layout("cp=2", dist.get_world_size()), "cpu")
    model = gpt2()
    before = [type(m) for m in model.modules()]
    try:
        meshlm.parallelize(model, mesh, plan=meshlm.ParallelPlan(**{**vars(GPT2_PLAN), "attention": ""}))
        message = "no error"
    except meshlm.PlanError as e:
        message = str(e)
    return message, [type(m) for m in model.modules()] == before


def test_plan_without_attention_is_refused_under_cp() -> None:
    for message, untouched in run_shared(_refused, 2):
        assert "has no context_parallel pattern and no attention pattern" in message and "\n" not in message
        assert untouched


@pytest.mark.parametrize("field", ["attention", "positions"])
def test_cp_patterns_matching_nothing_are_refused(field: str) -> None:
    from meshlm.parallel.cp.attention import check_cp_plan

    with pytest.raises(meshlm.PlanError, match=rf"{field} 'h\.\*\.nothing' matches no module of GPT2"):
        check_cp_plan(gpt2(), meshlm.ParallelPlan(**{**vars(GPT2_PLAN), field: "h.*.nothing"}))
