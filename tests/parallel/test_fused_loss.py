"""The fused, chunked output projection + cross-entropy (meshlm.parallel.transforms.fused_loss) equals the unfused loss.

fp32 on CPU: the loss sum and the gradients of the hidden states and the head weight within 1e-6 relative of
the unfused `token_cross_entropy(hidden @ Wᵀ).sum()` — the same products summed in another order (per chunk,
and with the gradients computed in forward), ~1e-7 apart — at world 1 and vocabulary-parallel at tp=2, with
-100 labels and several chunks; then training under layouts with `fused_loss` matches one unfused process.

Under ZeRO-3 the head's gathered weight must outlive the head's forward until the loss has run (the unit's
post-forward hook hands the HeadOutput a `release`): there the fused loss equals the unfused one at dp=2 (tied
and untied heads), with accumulation, pp=2 and tp=2 × dp=2; freeing the weight before the loss (the mutation)
fails; and the fused path saves the logits' bytes there too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import TEST_MODEL, assert_close_runs, assert_same_losses, train_layout

from meshlm.model import Transformer, token_cross_entropy
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel import engine
from meshlm.parallel.dp import zero
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import Loss
from meshlm.parallel.plan_registry import LLAMA
from meshlm.parallel.transforms import fused_loss
from meshlm.parallel.transforms.fused_loss import FusedLinearHead, HeadOutput, fused_cross_entropy_sum
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
        monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * elements)
        got = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w), targets), hidden, weight)
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-7)
    unmasked = fused_cross_entropy_sum(HeadOutput(hidden, weight), targets, ignore_index=-1)
    assert not torch.allclose(unmasked, ref[0], rtol=1e-3)  # the mask is what makes it equal


def _tp_check() -> list[str]:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    hidden, weight, targets = _inputs(24, world)
    ref = _grads(lambda h, w: token_cross_entropy(h @ w.t(), targets).sum(), hidden, weight)
    fused_loss.CHUNK_BYTES = 4 * 24 * 4  # several chunks of this rank's slice
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


def _init_world_of_one() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_fused_head_keeps_names_ties_and_eval_logits() -> None:
    torch.manual_seed(0)
    model = Transformer(TEST_MODEL.replace(tie_embeddings=True))
    _init_world_of_one()
    names = [n for n, _ in model.named_parameters()]
    pm = parallelize(model, build_mesh(parse_layout("", 1), "cpu"), plan=LLAMA, loss=Loss(fused=True))
    assert isinstance(model.lm_head, FusedLinearHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, TEST_MODEL.vocab_size, (2, 8))
    assert isinstance(model(x), HeadOutput)
    pm.train(False)
    assert model(x).shape == (2, 8, TEST_MODEL.vocab_size)


@contextlib.contextmanager
def _counting_fused_calls() -> Iterator[list]:
    """Counts the engine's calls of the fused loss: a run that never took the fused path proves nothing."""
    calls, original = [], engine.fused_cross_entropy_sum
    engine.fused_cross_entropy_sum = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        yield calls
    finally:
        engine.fused_cross_entropy_sum = original


def _fused_runs(runs: list) -> list[tuple[int, list[float]]]:
    out = []
    for layout, par, kw in runs:
        with _counting_fused_calls() as calls:
            losses = train_layout(layout, par, masked=0.3, fused_loss=True, **kw)["losses"]
        out.append((len(calls), losses))
    return out


RUNS = [("", {}, {}), ("tp=2", {"sequence_parallel": True}, {}), ("pp=2", {}, {"micro_batch": 2}),
        ("dp=2", {"zero": 2}, {"micro_batch": 2}), ("dp=2", {"zero": 3}, {})]  # fmt: skip
ZERO3_RUNS = [("dp=2", {"zero": 3}, {"micro_batch": 2}), ("pp=2", {"zero": 3}, {"micro_batch": 2})]  # accumulation
TIED = TEST_MODEL.replace(tie_embeddings=True)
ZERO3_RUNS_4 = [
    ("dp=2,tp=2", {"zero": 3, "sequence_parallel": True}, {}),
    ("pp=2,dp=2", {"zero": 3}, {"micro_batch": 2}),
    ("pp=2,dp=2", {"schedule": "zb1", "zero": 3}, {"micro_batch": 1, "model_cfg": TIED}),  # the tie across stages
]


def _assert_fused_runs_match(ref: dict, per_rank: list[list[tuple[int, list[float]]]], runs: list) -> None:
    tied_ref = None
    for i, (layout, par, kw) in enumerate(runs):
        if kw.get("model_cfg") == TIED:
            tied_ref = tied_ref or train_layout("", masked=0.3, model_cfg=TIED)
        assert sum(rank[i][0] for rank in per_rank) > 0, f"{layout} {par}: the fused loss never ran"
        losses = per_rank[-1][i][1]  # the last rank holds the pipeline's loss
        assert_same_losses(tied_ref if kw.get("model_cfg") == TIED else ref, {"losses": losses})


def test_training_with_the_fused_loss_matches_one_unfused_process() -> None:
    ref = train_layout("", masked=0.3)
    _assert_fused_runs_match(ref, [_fused_runs(RUNS[:1])], RUNS[:1])
    _assert_fused_runs_match(ref, run_shared(_fused_runs, 2, RUNS[1:]), RUNS[1:])


@pytest.mark.slow  # five more layouts, three of them on four gloo ranks: ~20 s on two cores
def test_fused_loss_under_zero3_with_accumulation_tp_and_pp_matches_one_unfused_process() -> None:
    ref = train_layout("", masked=0.3)
    _assert_fused_runs_match(ref, run_shared(_fused_runs, 2, ZERO3_RUNS), ZERO3_RUNS)
    _assert_fused_runs_match(ref, run_shared(_fused_runs, 4, ZERO3_RUNS_4), ZERO3_RUNS_4)


# ---- ZeRO-3: the head's gathered weight lives until the fused loss has run -------------------------------
class _NotAHead:
    """Stands in for HeadOutput in zero.py's post-forward hook: the head's unit is freed when its forward ends."""


def _zero3_fused_and_unfused(tied_heads: list[bool], free_before_loss: bool = False) -> list[dict]:
    """dp=2 ZeRO-3, 10 SGD steps (per-step losses and final weights) unfused then fused, per head kind; the
    fused run's 'error' is the exception it raised, if any."""
    out = []
    for tied in tied_heads:
        kwargs = {"model_cfg": TEST_MODEL.replace(tie_embeddings=tied), "masked": 0.3, "optimizer": "sgd", "steps": 10}
        unfused = train_layout("dp=2", {"zero": 3}, **kwargs)
        fused: dict = {}
        with _counting_fused_calls() as calls:
            if free_before_loss:
                zero.HeadOutput = _NotAHead
            try:
                fused = train_layout("dp=2", {"zero": 3}, fused_loss=True, **kwargs)
            except RuntimeError as e:  # both ranks fail at the same point, before any collective of the loss
                fused["error"] = str(e).splitlines()[0]
            finally:
                zero.HeadOutput = HeadOutput
        out.append({"unfused": unfused, "fused": fused, "calls": len(calls)})
    return out


def _failure(pair: dict) -> str | None:
    """Why the fused run differs from the unfused one, if it does: per-step losses within RTOL (the same fp32
    products summed in another order) and the final weights within criterion 2 (tests/equivalence.py)."""
    if "error" in pair["fused"]:
        return pair["fused"]["error"]
    try:
        assert_close_runs(pair["unfused"], pair["fused"], rtol=RTOL)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


def test_fused_loss_under_zero3_equals_the_unfused_loss_tied_and_untied() -> None:
    for tied, pair in zip((False, True), run_shared(_zero3_fused_and_unfused, 2, [False, True])[0], strict=True):
        assert pair["calls"] == 10, f"tied={tied}: the fused loss ran {pair['calls']} times, not once a step"
        assert _failure(pair) is None, f"tied={tied}: {_failure(pair)}"


def test_head_weight_freed_before_the_fused_loss_is_caught() -> None:
    [pair] = run_shared(_zero3_fused_and_unfused, 2, [False], True)[0]
    assert pair["calls"] == 1  # the fused loss ran once, on the freed weight, and failed the check
    assert "a ZeRO-3 parameter was read" in (_failure(pair) or ""), _failure(pair)  # FreedParameterError


def _zero3_saved_bytes(fused: bool, tied: bool) -> tuple[int, list[tuple[int, int]]]:
    """Peak bytes saved for backward by one ZeRO-3 training step (world 1), and, per fused loss call, the head
    weight's storage bytes when the loss starts and when it returns."""
    _init_world_of_one()
    torch.manual_seed(0)
    model = Transformer(MEMORY_MODEL.replace(tie_embeddings=tied))
    pm = parallelize(model, build_mesh(parse_layout("", 1), "cpu"), {"zero": 3}, plan=LLAMA, loss=Loss(fused=fused))
    weight_bytes = []
    original = engine.fused_cross_entropy_sum

    def observed(head: HeadOutput, *args: object) -> torch.Tensor:
        before = head.weight.untyped_storage().nbytes()
        loss = original(head, *args)
        weight_bytes.append((before, head.weight.untyped_storage().nbytes()))
        return loss

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, MEMORY_MODEL.vocab_size, (*MEMORY_TOKENS,), generator=g) for _ in range(2))
    engine.fused_cross_entropy_sum = observed
    try:
        with ActivationMeter(model) as meter:
            pm.forward_backward(x, y)
    finally:
        engine.fused_cross_entropy_sum = original
    return meter.peak, weight_bytes


MEMORY_MODEL = TEST_MODEL.replace(vocab_size=2048, n_layers=1)  # the logits dominate what a step saves
MEMORY_TOKENS = (4, 64)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_loss_under_zero3_saves_the_logits_and_frees_the_head_after_the_loss(tied: bool) -> None:
    unfused, no_calls = _zero3_saved_bytes(fused=False, tied=tied)
    fused, weight_bytes = _zero3_saved_bytes(fused=True, tied=tied)
    assert no_calls == []
    head_bytes = MEMORY_MODEL.vocab_size * MEMORY_MODEL.dim * 4
    # Gathered (the whole fp32 head weight; tied, the embedding's unit) while the loss runs, freed once it returned.
    assert weight_bytes == [(head_bytes, 0)]
    # The unfused step keeps fp32 log-probabilities of every token (tokens × vocab × 4 B); the fused one keeps
    # the head weight's fp32 gradient instead (vocab × dim × 4 B): it saves at least the difference.
    logits_bytes = MEMORY_TOKENS[0] * MEMORY_TOKENS[1] * MEMORY_MODEL.vocab_size * 4
    assert unfused - fused >= logits_bytes - head_bytes, (unfused, fused)
