"""A GPT-2-style decoder that is *not* meshlm's Llama: LayerNorm, GELU MLP, learned positions, biases.

It stands for a team's own model: plain single-device PyTorch, plus the one table (`GPT2_PLAN`) that tells
meshlm's strategies which modules to split. Its forward skips the parts a pipeline stage does not hold
(None), the convention meshlm's pipeline split relies on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshlm


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads  # head counts follow the projection widths: tp shards run this code
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, n_heads),
            nn.LayerNorm(dim),
            MLP(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(
        self, vocab: int = 512, dim: int = 64, n_layers: int = 4, n_heads: int = 4, max_len: int = 128
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.h = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # first pipeline stage: token ids in
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            x = block(x)
        if self.ln_f is not None:  # last pipeline stage: logits out
            x = self.head(self.ln_f(x))
        return x


def _check_heads(model: GPT2, tp: int) -> None:
    if model.n_heads % tp:
        raise meshlm.PlanError(f"GPT2: n_heads ({model.n_heads}) is not divisible by tp={tp}")


GPT2_PLAN = meshlm.ParallelPlan(
    name="gpt2",
    tensor_parallel={
        "wte": meshlm.VOCAB_EMBEDDING,
        "h.*.attn.[qkv]": meshlm.COLWISE,
        "h.*.attn.out": meshlm.ROWWISE,
        "h.*.mlp.fc": meshlm.COLWISE,
        "h.*.mlp.proj": meshlm.ROWWISE,
        "head": meshlm.VOCAB_HEAD,
    },
    zero3_units=("Block",),
    pipeline=meshlm.PipelineSplit(layers="h", first=("wte", "wpe"), last=("ln_f", "head")),
    check=_check_heads,
)
