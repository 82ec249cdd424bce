"""The fused, chunked output projection + cross-entropy (meshlm.parallel.fused_loss) equals the unfused loss.

fp32 on CPU: the loss sum and the gradients of the hidden states and the head weight within 1e-6 relative of
the unfused `token_cross_entropy(hidden @ Wᵀ).sum()` — the same products summed in another order (per chunk,
and with the gradients computed in forward), ~1e-7 apart — at world 1 and vocabulary-parallel at tp=2, with
-100 labels and several chunks; then training under layouts with `fused_loss` matches one unfused process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import TEST_MODEL, assert_same_losses, train_layout

from meshlm.config import ParallelSection
from meshlm.model import Transformer, token_cross_entropy
from meshlm.parallel import fused_loss
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.fused_loss import FusedLinearHead, HeadOutput, fused_cross_entropy_sum
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.plans import LLAMA
from meshlm.testing import mask_prompts

RTOL = 1e-6  # fp32 sums of the same products in another order: ~1e-7 relative


def _inputs(vocab: int, world: int = 1):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 16, generator=g)
    weight = torch.randn(vocab * world, 16, generator=g) * 0.3
    targets = torch.randint(0, vocab * world, (3, 7), generator=g)
    return hidden, weight, mask_prompts(targets, 0, 0.3)


def _grads(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    (loss * 0.37).backward()  # a scale, as the engine's 1 / kept tokens
    return loss.detach(), h.grad, w.grad


def test_fused_equals_unfused_in_value_and_gradients_across_chunks(monkeypatch) -> None:
    hidden, weight, targets = _inputs(40)
    ref = _grads(lambda h, w: token_cross_entropy(h @ w.t(), targets).sum(), hidden, weight)
    for elements in (40 * 5, 40 * 21, 1 << 25):  # chunks of 5 tokens, of 21 (one full, one short), one chunk
        monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", elements)
        got = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w), targets), hidden, weight)
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-7)
    unmasked = fused_cross_entropy_sum(HeadOutput(hidden, weight), targets, ignore_index=-1)
    assert not torch.allclose(unmasked, ref[0], rtol=1e-3)  # the mask is what makes it equal


def _tp_check() -> list[str]:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    hidden, weight, targets = _inputs(24, world)
    ref = _grads(lambda h, w: token_cross_entropy(h @ w.t(), targets).sum(), hidden, weight)
    fused_loss.CHUNK_ELEMENTS = 24 * 4  # several chunks of this rank's slice
    got = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w.chunk(world)[rank], group), targets),
                 hidden, weight)  # fmt: skip
    grad_h = got[1].clone()
    dist.all_reduce(grad_h)  # what the head's input region (Megatron's f) does in backward
    errors = []
    rows = ref[2].chunk(world)[rank], got[2].chunk(world)[rank]  # this rank's vocabulary slice of the gradient
    for name, a, b in (("loss", ref[0], got[0]), ("hidden", ref[1], grad_h), ("weight", *rows)):
        if not torch.allclose(a, b, rtol=RTOL, atol=1e-7):
            errors.append(f"{name}: {(a - b).abs().max().item()}")
    return errors


def test_vocab_parallel_fused_equals_unfused_at_tp2() -> None:
    assert run_shared(_tp_check, 2) == [[], []]


def test_fused_head_keeps_names_ties_and_eval_logits() -> None:
    torch.manual_seed(0)
    model = Transformer(TEST_MODEL.replace(tie_embeddings=True))
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    names = [n for n, _ in model.named_parameters()]
    pm = ParallelModel(model, build_mesh(parse_layout("", 1), "cpu"), ParallelSection(), 1, plan=LLAMA, fused_loss=True)
    assert isinstance(model.lm_head, FusedLinearHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, TEST_MODEL.vocab_size, (2, 8))
    assert isinstance(model(x), HeadOutput)
    pm.train(False)
    assert model(x).shape == (2, 8, TEST_MODEL.vocab_size)


def _fused_runs(runs: list) -> list[list[float]]:
    return [train_layout(layout, par, masked=0.3, fused_loss=True, **kw)["losses"] for layout, par, kw in runs]


RUNS = [("", {}, {}), ("tp=2", {"sequence_parallel": True}, {}), ("pp=2", {}, {"micro_batch": 2}),
        ("dp=2", {"zero": 2}, {"micro_batch": 2}), ("dp=2", {"zero": 3}, {})]  # fmt: skip


def test_training_with_the_fused_loss_matches_one_unfused_process() -> None:
    ref = train_layout("", masked=0.3)
    assert_same_losses(ref, {"losses": _fused_runs(RUNS[:1])[0]})
    for losses in run_shared(_fused_runs, 2, RUNS[1:])[0]:
        assert_same_losses(ref, {"losses": losses})
