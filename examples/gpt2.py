"""A GPT-2-style decoder that is *not* meshlm's Llama: LayerNorm, GELU MLP, learned positions, biases, and
GPT-2's fused attention projection `c_attn` ([all Q | all K | all V] in one Linear).

It stands for a team's own model: plain single-device PyTorch, plus the one table (`GPT2_PLAN`) that tells
meshlm's strategies which modules to split. Its forward skips the parts a pipeline stage does not hold
(None), the convention meshlm's pipeline split relies on; its attention core is a module of its own
(`CausalAttention`) so that context parallelism can replace it; `init_weights()` is its initialisation
(GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)), which meshlm runs on a model built
on the `meta` device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import meshlm


class CausalAttention(nn.Module):
    """The attention core: q, k, v (batch, heads, seq, head_dim) -> causal attention. Under context parallel
    meshlm swaps it (the plan's `attention` pattern) for ring or Ulysses attention over the cp group."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads  # head counts follow the projection widths: tp shards run this code
        self.c_attn = nn.Linear(dim, 3 * dim)  # [Q | K | V]: under tp each rank holds [q_r | k_r | v_r]
        self.core = CausalAttention()
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


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
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation. Built on `meta` this draws nothing; meshlm calls it on the materialised
        model (docs/api.md, "Models larger than one device")."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 1:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * len(self.h)) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # first pipeline stage: token ids in (positions: see GPT2_PLAN.positions)
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            x = block(x)
        if self.ln_f is not None:  # last pipeline stage: logits out
            x = self.head(self.ln_f(x))
        return x


GPT2_PLAN = meshlm.ParallelPlan(
    name="gpt2",
    tensor_parallel={
        "wte": meshlm.VOCAB_EMBEDDING,
        "h.*.attn.c_attn": meshlm.FusedColwise(blocks=3, heads=True),  # [Q | K | V]: a slice of each block
        "h.*.attn.c_proj": meshlm.ROWWISE,
        "h.*.mlp.c_fc": meshlm.COLWISE,
        "h.*.mlp.c_proj": meshlm.ROWWISE,
        "head": meshlm.VOCAB_HEAD,
    },
    zero3_units=("Block",),
    pipeline=meshlm.PipelineSplit(layers="h", first=("wte", "wpe"), last=("ln_f", "head")),
    attention="h.*.attn.core",  # context parallel: the (q, k, v) -> out modules it replaces
    positions="wpe",  # context parallel: fed local positions 0..n-1, it gets the tokens' global ones
    head_dim=lambda model: model.h[0].attn.head_dim,  # FusedColwise(heads=True) splits at head boundaries
)
