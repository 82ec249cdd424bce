"""A Llama-style decoder in plain single-device PyTorch.

Parameter names match Hugging Face `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...) and
rotary embeddings use the same rotate-half convention, so HF checkpoints load without permutation.
There is no parallel logic here: tensor parallelism swaps the Linear/Embedding modules, pipeline
parallelism deletes the parts a stage does not own (hence a ModuleDict of layers keyed by global index,
and optional embedding / norm / head), and data parallelism only touches parameters and gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshlm.model.config import ModelConfig
from meshlm.model.init import Constant, InitRule, Normal, fill_
from meshlm.model.moe import MoE

if TYPE_CHECKING:
    from meshlm.model.pretrained import HFWeights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1's RoPE frequency rule, as transformers' `_compute_llama3_parameters` computes it: wavelengths
    under original/high kept, over original/low divided by `factor`, and smoothly interpolated between."""
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    llama3: tuple[float, float, float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim) in the rotate-half layout used by HF Llama;
    `llama3` = (factor, low_freq_factor, high_freq_factor, original_max_seq_len) scales the frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if llama3 is not None:
        inv_freq = llama3_scaled(inv_freq, *llama3)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.int64, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by position; cos/sin are (seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The attention core: rotate q/k (batch, heads, seq, head_dim) by positions 0..seq-1 of the whole
    cos/sin tables, then causal grouped-query attention. Context parallelism replaces it (Attention.core)."""
    s = q.shape[2]
    if s > cos.shape[0]:
        raise ValueError(f"sequence length {s} exceeds model.max_seq_len {cos.shape[0]}")
    cos, sin = cos[:s], sin[:s]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Causal grouped-query attention. Head counts are read from the projection widths at run time,
    so a tensor-parallel rank holding a slice of the heads runs the same code. With `sliding_window` set
    (Mistral) longer sequences are refused: full causal attention equals it only within the window.
    `core` (rotary + attention over the heads) is a plain attribute so a parallel transform can swap it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3: an RMSNorm over each query and key head (weights of head_dim), before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core: Callable[..., torch.Tensor] = causal_attention
        self.recompute_core = False  # selective recompute (set_recompute)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cos/sin are the model's whole tables; the sequence length is read after the projections, which
        under sequence parallelism see more positions than the block's input holds."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s, _ = q.shape
        if self.sliding_window and s > self.sliding_window:
            raise ValueError(f"sequence length {s} exceeds model.sliding_window {self.sliding_window}")
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core and self.training:
            out = checkpoint(self.core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self.core(q, k, v, cos, sin)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), of width `intermediate_size` (the config's by default)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.dim, width, bias=False)
        self.up_proj = nn.Linear(cfg.dim, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer (HF name: LlamaDecoderLayer); layer `index` of an MoE model listed in
    `cfg.moe_layers` has a mixture of experts (meshlm.model.moe.MoE) as its `mlp`."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if index in cfg.moe_layers:
            shared = MLP(cfg, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
            self.mlp: nn.Module = MoE(cfg, shared)
        else:
            self.mlp = MLP(cfg)
        self.recompute_mlp = False  # op-level recompute of the feed-forward half (set_recompute)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's second half, from its mid-point (the residual after attention) to its output."""
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        if self.recompute_mlp and self.training:
            return checkpoint(self.feed_forward, x, use_reentrant=False)
        return self.feed_forward(x)


class Decoder(nn.Module):
    """Embedding, layers and final norm (HF name: LlamaModel). Any part may be None on a pipeline stage."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Transformer.reset_parameters initialises it: skipping nn.Embedding's own normal_ also keeps a meta
        # build from loading PyTorch's Python meta kernels for it (sympy and friends, ~70 MiB per process).
        weight = torch.empty(cfg.vocab_size, cfg.dim)
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=weight)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)


class Transformer(nn.Module):
    """The whole causal LM. `forward(tokens)` returns logits; on a pipeline stage it maps the stage's
    input (tokens or hidden states) to its output (hidden states or logits).

    Weights are a function of `init_seed` (default: `torch.initial_seed()`, i.e. the last
    `torch.manual_seed`) and of each element's name and index (meshlm.model.init), not of the global RNG
    stream: built on the `meta` device, the parallel engine initialises only each rank's shard of them, and
    every layout gets the weights `Transformer(cfg)` has in one process. With `init_source` (a checkpoint's
    files, meshlm.model.pretrained.HFWeights; `model.init_from`) built on `meta`, the engine reads each rank's
    region of them instead."""

    def __init__(self, cfg: ModelConfig, init_seed: int | None = None, init_source: HFWeights | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_seed = torch.initial_seed() if init_seed is None else init_seed
        self.init_source = init_source  # read by meshlm.parallel.materialize.MetaInit (the init protocol)
        self.model = Decoder(cfg)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Constants of the shape, not state: real (on the CPU) even in a meta build, moved with the model.
        tables_device = "cpu" if self.lm_head.weight.is_meta else None
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, tables_device, cfg.llama3_rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self.recompute_layers = 0  # the first N blocks this module runs are fully recomputed (set_recompute)
        self.reset_parameters()

    def init_rule(self, name: str, param: torch.Tensor) -> InitRule:
        """Normal(0, init_std) for matrices (routers and stacked experts too), zeros for biases, ones for norms;
        output projections (each expert's too) scaled by 1/sqrt(2·L)."""
        if name.endswith(".bias"):
            return Constant(0.0)
        if param.ndim == 1:
            return Constant(1.0)
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return Normal(self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5)
        return Normal(self.cfg.init_std)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every (non-meta) parameter from `init_rule`, element by element (meshlm.model.init.fill_)."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                fill_(p.view(-1), self.init_rule(name, p), self.init_seed, name, p.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        cos, sin = self.rope_cos, self.rope_sin
        for i, layer in enumerate(self.model.layers.values()):
            if (self.activation_checkpointing or i < self.recompute_layers) and self.training:
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if self.model.norm is not None:
            h = self.model.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (top_k of n_experts)."""
        unused = 0
        for module in self.modules():
            if isinstance(module, MoE):
                per_expert = sum(p[0].numel() for p in module.experts.parameters())
                unused += (module.n_experts - module.top_k) * per_expert
        return self.num_params() - unused


def set_recompute(model: nn.Module, policy: str, layers: int = 0) -> None:
    """Activation recompute of meshlm's Llama (`train.recompute`, `train.recompute_layers`): 'full' keeps
    only each block's input and reruns the block in backward; 'mlp' keeps the block's mid-point (the residual
    after attention) and reruns the second RMSNorm and the SwiGLU MLP (gate, up, silu, product, down), so
    none of the MLP's intermediates are stored; 'selective' reruns only the attention core (rotary +
    attention), so the softmax probabilities are never stored (Korthikanti et al. 2022; a flash kernel
    stores none anyway, then only its softmax statistics are saved); 'none' keeps everything. `layers` > 0
    recomputes the first `layers` blocks of each pipeline chunk fully and the rest by `policy` (Megatron's
    `--recompute-num-layers`). Planned by meshlm.plan.memory.layer_activation_bytes, measured by
    tests/parallel/test_recompute.py and benchmarks/recompute.py."""
    model.activation_checkpointing = policy == "full"
    model.recompute_layers = layers
    for module in model.modules():
        if isinstance(module, Attention):
            module.recompute_core = policy == "selective"
        if isinstance(module, Block):
            module.recompute_mlp = policy == "mlp"


IGNORE_INDEX = -100  # the target id of tokens that carry no loss (Hugging Face's and PyTorch's convention)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean token cross-entropy in fp32 over the targets that are not `ignore_index` (the loss every parallel
    layout must reproduce: sum over kept tokens / count of kept tokens)."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross-entropy in fp32, shaped like `targets`, 0 where the target is `ignore_index`: the
    form of loss a ParallelModel takes, so that it can average over the kept tokens of the global batch."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    losses = F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index, reduction="none")
    return losses.view(targets.shape)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_token: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """Sample continuations of `prompt` (batch, seq). temperature 0 means greedy. With `stop_token` (the end of a
    document or of a chat turn; one id or several) a row that has sampled one keeps repeating it, and sampling
    ends once every row has: the result is then shorter than prompt + max_new_tokens."""
    model.eval()
    tokens = prompt
    stops = None if stop_token is None else torch.tensor(stop_token, device=prompt.device).reshape(-1)
    done = torch.zeros(prompt.shape[0], 1, dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if stop_token is not None and bool(done.all()):
            break
        context = tokens[:, -model.cfg.max_seq_len :]
        logits = model(context)[:, -1, :].float()
        if temperature == 0:
            next_token = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        if stops is not None:
            next_token = torch.where(done, tokens[:, -1:], next_token)
            done |= torch.isin(next_token, stops)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens
