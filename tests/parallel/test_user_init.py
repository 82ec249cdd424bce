"""A user's model built on `meta` keeps its own initialisation (the init protocol, docs/api.md).

The GPT-2-style example defines `init_weights()` (GPT-2's N(0, 0.02)); built on meta, its constructor draws
nothing, and meshlm runs `init_weights()` once on a whole CPU copy under the agreed seed and keeps each
rank's slices. At tp=2 (fused c_attn: several runs per shard), dp=2 ZeRO-3 and pp=2 the initial weights must
equal, bit for bit, world 1's and the protocol's reference (`to_empty(cpu); manual_seed(seed);
init_weights()`), and the first loss must be the user's model's (about ln V), not that of the modules'
default init (the 117.6 of issue 28). A meta module nothing initialises is refused in one line.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import assert_identical_weights, global_batch
from torch import nn

import meshlm
from meshlm.parallel.materialize import InitError, MetaInit
from meshlm.parallel.mesh import build_mesh, parse_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt2 import GPT2, GPT2_PLAN

VOCAB, SEQ, SEED = 128, 16, 7
LAYOUTS = [("", {}, 1), ("tp=2", {}, 1), ("dp=2", {"zero": 3}, 1), ("pp=2", {}, 2)]  # layout, options, micro


def meta_gpt2() -> GPT2:
    with torch.device("meta"):
        return GPT2(vocab=VOCAB, dim=32, n_layers=2, n_heads=4, max_len=SEQ)


def reference() -> dict[str, torch.Tensor]:
    """The protocol's reference in one plain process: materialise on the CPU, seed, init_weights()."""
    model = meta_gpt2()
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _starts() -> list[dict]:
    out = []
    for layout, options, micro_batches in LAYOUTS[1:]:
        torch.manual_seed(SEED + dist.get_rank())  # the ranks disagree: rank 0's seed is the one used
        model = meta_gpt2()
        mesh = build_mesh(parse_layout(layout, dist.get_world_size()), "cpu")
        pm = meshlm.parallelize(model, mesh, {**options, "micro_batches": micro_batches}, plan=GPT2_PLAN)
        x, y = global_batch(0, 4, SEQ, VOCAB)
        loss = pm.eval_loss(pm.local_batch(x), pm.local_batch(y)).item()
        out.append({"start": pm.full_state_dict(), "loss": loss})
    return out


def test_meta_model_init_weights_survives_every_layout() -> None:
    want = reference()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(SEED)
    world1 = meshlm.parallelize(meta_gpt2(), build_mesh(parse_layout("", 1), "cpu"), plan=GPT2_PLAN)
    assert_identical_weights(want, world1.full_state_dict())
    assert want["wte.weight"].std().item() == pytest.approx(0.02, rel=0.1)  # GPT-2's, not nn.Embedding's 1.0
    for rank, starts in enumerate(run_shared(_starts, 2)):
        for (layout, options, micro_batches), got in zip(LAYOUTS[1:], starts, strict=True):
            try:
                assert_identical_weights(want, got["start"])
            except AssertionError as e:
                raise AssertionError(f"rank {rank} {layout} {options} {micro_batches}: {e}") from None
            # The user's small init gives a first loss near ln(vocab), as a model built whole does.
            assert abs(got["loss"] - math.log(VOCAB)) < 0.1, (layout, got["loss"])


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_meta_model_without_an_init_protocol_is_refused_in_one_line() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(InitError) as err:
        MetaInit(model, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message
    assert "module 1 (_Scale) has meta parameters" in message
    assert "give the model an init_weights() method" in message and "reset_parameters()" in message


class _InitInConstructor(nn.Module):
    """nanoGPT's habit without init_weights(): the init written in __init__, which on meta draws nothing."""

    def __init__(self, init_in_constructor: bool = True) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)
        self.norm = nn.LayerNorm(32)
        if init_in_constructor:
            nn.init.normal_(self.embed.weight, std=0.02)  # built whole: first loss ≈ ln V, not nn.Embedding's N(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def test_meta_model_with_an_init_in_its_constructor_is_refused_in_one_line() -> None:
    """meshlm would fill embed.weight from nn.Embedding.reset_parameters() (N(0, 1)), silently not the model the
    eager build gives: the extra in-place write, counted by the meta tensor's version, is refused instead."""
    with torch.device("meta"):
        model = _InitInConstructor()
    with pytest.raises(InitError) as err:
        MetaInit(model, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and "parameter embed.weight was written in place 1 more time(s)" in message, message
    assert "init_weights()" in message, message
    with torch.device("meta"):  # the modules' own reset_parameters() only: meshlm reproduces it, accepted
        plain = _InitInConstructor(init_in_constructor=False)
        tied = _Tied()
    for accepted in (plain, tied):
        MetaInit(accepted, torch.device("cpu"))


class _ScaledModel(nn.Sequential):
    """The same model, with the protocol: init_weights() initialises what no module can."""

    def init_weights(self) -> None:
        self[0].reset_parameters()
        nn.init.ones_(self[1].gain)


def test_init_weights_covers_modules_without_reset_parameters() -> None:
    with torch.device("meta"):
        model = _ScaledModel(nn.Linear(4, 4), _Scale())
    init = MetaInit(model, torch.device("cpu"))
    gain = torch.empty(4)
    init.fill(model[1].gain, gain, name="1.gain")
    assert torch.equal(gain, torch.ones(4))


def test_init_rule_types_are_public() -> None:
    assert meshlm.Normal(0.02).std == 0.02 and meshlm.Constant(1.0).value == 1.0


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)  # the same tensor: this second draw is what both hold


def test_init_weights_keeps_tied_parameters_tied() -> None:
    torch.manual_seed(0)
    want = _Tied()
    torch.manual_seed(SEED)
    want.init_weights()
    with torch.device("meta"):
        model = _Tied()
    model.init_seed = SEED
    init = MetaInit(model, torch.device("cpu"))
    for name in ("embed.weight", "head.weight"):
        got = torch.empty(32)
        init.fill(model.embed.weight, got, name=name)
        assert torch.equal(got.view(8, 4), want.embed.weight.detach()), name
