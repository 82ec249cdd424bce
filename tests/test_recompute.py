"""`train.recompute`: selective (the attention core) and full (each block) recompute train exactly as
keeping every activation does, and the activation bytes autograd saves per layer are what the planner's
per-layer formula (meshlm.plan.memory.layer_activation_bytes) says for each policy."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlm.model import Transformer, cross_entropy_loss, preset
from meshlm.model.llama import set_recompute
from meshlm.observe.memory import ActivationMeter
from meshlm.plan.memory import layer_activation_bytes

MODEL = preset("test")
BATCH, SEQ_LEN = 2, 32
# The planner's standard for measured memory (tests/test_plan_measured.py): within 10 %. The formula counts
# the per-token activations of docs/planner.md and leaves out what is small or kernel-specific: the softmax
# statistics a flash kernel keeps (n_heads floats per token, 0.2 % here) and, with the math kernel, the
# grouped K/V it expands to every query head and its pre-softmax scores (measured 5.4 % over). A selective
# policy that recomputed nothing would keep the probabilities: 18 % over the formula with the math kernel.
TOLERANCE = 0.10


def _losses_and_weights(policy: str, steps: int = 10) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(MODEL)
    set_recompute(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
        loss = cross_entropy_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_selective_and_full_recompute_train_exactly_as_none() -> None:
    reference, ref_weights = _losses_and_weights("none")
    for policy in ("selective", "full"):
        losses, weights = _losses_and_weights(policy)
        assert losses == reference, policy  # recompute reruns the same kernels on the same inputs: bitwise
        for name, tensor in ref_weights.items():
            assert torch.equal(tensor, weights[name]), (policy, name)


def _saved_bytes(n_layers: int, policy: str) -> int:
    torch.manual_seed(0)
    model = Transformer(MODEL.replace(n_layers=n_layers))
    set_recompute(model, policy)
    x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN))
    with ActivationMeter(model) as meter:
        loss = cross_entropy_loss(model(x), x)
    loss.backward()
    return meter.peak


@pytest.mark.parametrize(
    ("policy", "flash"),
    [("none", True), ("selective", True), ("full", True), ("none", False), ("selective", False)],
)
def test_measured_activations_per_layer_match_the_planner(policy: str, flash: bool) -> None:
    kernel = contextlib.nullcontext() if flash else sdpa_kernel(SDPBackend.MATH)
    with kernel:
        measured = _saved_bytes(2, policy) - _saved_bytes(1, policy)  # one layer's worth, logits cancel
    planned = layer_activation_bytes(MODEL, SEQ_LEN, BATCH, 1, False, policy, "fp32", flash)
    assert abs(planned / measured - 1) <= TOLERANCE, (measured, planned)
