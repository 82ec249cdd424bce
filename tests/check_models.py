"""User models and plans for the check's tests (tests/test_check_*.py): module-level, as `meshlm.check`'s ranks
import them by name.

`KBias` is a GPT-NeoX-style decoder as a user writes it: one biased `qkv` Linear ([Q | K | V] blocks), so the
K part of its bias gets no gradient in exact arithmetic (softmax is invariant to adding one number to every
score of a row), a GELU MLP (`up`, `down`), LayerNorms, no position encoding (causal attention orders the
tokens). `KBIAS_PLAN` is its correct plan (docs/api.md's fused projections); the mutations below are the plan
mistakes and model edits the check must name.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from meshlm.testing import global_batch

VOCAB, DIM, HEADS, LAYERS, BATCH, SEQ = 64, 32, 4, 2, 8, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)  # [Q | K | V]; K's bias shifts every score of a row alike
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class KBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # the first pipeline stage
            x = self.embed(x)
        for block in self.layers:
            x = block(x)
        if self.head is not None:  # the last pipeline stage
            x = self.head(self.norm(x))
        return x


KBIAS_PLAN = meshlm.ParallelPlan(
    name="kbias",
    tensor_parallel={
        "embed": meshlm.VOCAB_EMBEDDING,
        "layers.*.attn.qkv": meshlm.FusedColwise(blocks=3, heads=True),
        "layers.*.attn.dense": meshlm.ROWWISE,
        "layers.*.mlp.up": meshlm.COLWISE,
        "layers.*.mlp.down": meshlm.ROWWISE,
        "head": meshlm.VOCAB_HEAD,
    },
    zero3_units=("layers.*",),
    pipeline=meshlm.PipelineSplit(layers="layers", first=("embed",), last=("norm", "head")),
    head_dim=lambda model: model.layers[0].attn.head_dim,
)


def kbias_plan(**entries: object) -> meshlm.ParallelPlan:
    """KBIAS_PLAN with some tensor-parallel entries replaced."""
    return dataclasses.replace(KBIAS_PLAN, tensor_parallel={**KBIAS_PLAN.tensor_parallel, **entries})


# The plan mistakes: a blocked [Q | K | V] declared per head; a plain up projection declared as two fused
# blocks; a row-parallel layer declared colwise.
PER_HEAD_QKV = kbias_plan(**{"layers.*.attn.qkv": meshlm.InterleavedColwise(per_head=3)})
FUSED_UP = kbias_plan(**{"layers.*.mlp.up": meshlm.FusedColwise(2)})
DOWN_COLWISE = kbias_plan(**{"layers.*.mlp.down": meshlm.COLWISE})


class MidMLP(MLP):
    """An MLP with a Linear added between up and down, left out of the plan."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(4 * DIM, 4 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.mid(F.gelu(self.up(x))))


def kbias() -> KBias:
    return KBias()


def kbias_with_mid() -> KBias:
    model = KBias()
    for block in model.layers:
        block.mlp = MidMLP()
    return model


def batches(steps: int = 5) -> list:
    return [global_batch(step, BATCH, SEQ, VOCAB) for step in range(steps)]


def unprobed() -> None:
    """Switch off, in this rank, the build-time tensor-parallel probe `parallelize` runs where the tree has one
    (meshlm.parallel.tp.probe.probe_tensor_parallel: it refuses these plan mistakes before step 1, naming the
    entry): the naming tests test the check's own localisation, which must name the entry without it."""
    from meshlm.parallel.tp import probe

    probe.probe_tensor_parallel = lambda model, plan, tp: None


def kbias_unprobed() -> KBias:
    unprobed()
    return KBias()


def kbias_with_mid_unprobed() -> KBias:
    unprobed()
    return kbias_with_mid()
