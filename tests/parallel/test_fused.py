"""Fused projections under tensor parallel: FusedColwise (blocked, equal or unequal blocks) and
InterleavedColwise (per-head [q|k|v]).

Three models meshlm's Llama is not: the GPT-2-style example (examples/gpt2.py: c_attn = [Q | K | V] in one
Linear, equal blocks), a Phi-3-style model (qkv_proj with unequal Q / K / V blocks under grouped-query
attention, gate_up_proj = [gate | up], sequence-parallel norms) and a GPT-NeoX-style one (query_key_value
interleaved per head). Each trains under tp=2 (Phi-3 also with sequence parallel) and dp=2×tp=2 (ZeRO-1 or 3)
as in one process (tests/equivalence.py: per-step loss and grad norm within 1e-5 relative over 10 AdamW
steps; final weights of SGD runs through `full_state_dict`, which unshards by each parameter's Shard over tp).
A checkpoint saved at dp=2×tp=2 ZeRO-3 loads at world 1 bit for bit; a meta-built model with an init_rule
starts from the one-process weights at tp=2 ZeRO-3. The mutation (c_attn split as a plain colwise) is refused
before step 1 by the build-time probe; a wrong block spec is a one-line PlanError.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed, run_shared
from equivalence import assert_close_runs, assert_identical_weights, global_batch
from torch import nn

import meshlm
from meshlm.model.init import fill_
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.tp.rules import check_tp_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt2 import GPT2, GPT2_PLAN

STEPS, SGD_STEPS, BATCH, SEQ, VOCAB, DIM = 10, 4, 8, 16, 64, 32


# ---- a Phi-3-style model: unequal fused qkv (GQA) and fused gate_up ------------------------------------------
class Phi3Attention(nn.Module):
    def __init__(self, n_heads: int, n_kv: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.qkv_proj = nn.Linear(DIM, (n_heads + 2 * n_kv) * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        b, s, _ = qkv.shape  # under sequence parallel x is this rank's sequence shard, qkv the whole sequence
        # Split by proportion, so a tp rank's [q_r | k_r | v_r] splits the same way.
        q_width = qkv.shape[-1] * self.n_heads // (self.n_heads + 2 * self.n_kv)
        kv_width = (qkv.shape[-1] - q_width) // 2
        q, k, v = (
            t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in qkv.split([q_width, kv_width, kv_width], -1)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Phi3MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Phi3Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.self_attn, self.mlp = Phi3Attention(n_heads=4, n_kv=2, head_dim=8), Phi3MLP(48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Phi3(nn.Module):
    """No position encoding (causal attention alone orders the tokens), so it runs on sequence shards."""

    def __init__(self, init_seed: int = 0) -> None:
        super().__init__()
        self.init_seed = init_seed
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Phi3Block() for _ in range(2))
        self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.is_meta:
                    fill_(p.view(-1), self.init_rule(name, p), init_seed, name, p.shape)

    def init_rule(self, name: str, param: torch.Tensor) -> meshlm.Normal | meshlm.Constant:
        return meshlm.Constant(1.0) if param.ndim == 1 else meshlm.Normal(0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(x)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


PHI3_PLAN = meshlm.ParallelPlan(
    name="phi3-style",
    tensor_parallel={
        "embed_tokens": meshlm.VOCAB_EMBEDDING,
        "layers.*.self_attn.qkv_proj": meshlm.FusedColwise(
            lambda m: tuple(n * 8 for n in (4, 2, 2)), heads=True
        ),  # Q of 4 heads, K and V of 2 each
        "layers.*.self_attn.o_proj": meshlm.ROWWISE,
        "layers.*.mlp.gate_up_proj": meshlm.FusedColwise(2),
        "layers.*.mlp.down_proj": meshlm.ROWWISE,
        "layers.*.*_layernorm": meshlm.SEQUENCE_PARALLEL,
        "norm": meshlm.SEQUENCE_PARALLEL,
        "lm_head": meshlm.VOCAB_HEAD,
    },
    zero3_units=("layers.*",),
    sequence_parallel=True,
    head_dim=lambda model: 8,
)


# ---- a GPT-NeoX-style model: query_key_value interleaved per head -----------------------------------------
class NeoXAttention(nn.Module):
    def __init__(self, n_heads: int = 4) -> None:
        super().__init__()
        self.head_dim = DIM // n_heads
        self.query_key_value = nn.Linear(DIM, 3 * DIM)  # per head h: [q_h | k_h | v_h]
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        return self.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class NeoXBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.attention = nn.LayerNorm(DIM), NeoXAttention()
        self.post_attention_layernorm = nn.LayerNorm(DIM)
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # GPT-NeoX's parallel residual
        mlp = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + self.attention(self.input_layernorm(x)) + mlp


class NeoX(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(NeoXBlock() for _ in range(2))
        self.final_layer_norm, self.embed_out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(x)
        for block in self.layers:
            x = block(x)
        return self.embed_out(self.final_layer_norm(x))


NEOX_PLAN = meshlm.ParallelPlan(
    name="neox-style",
    tensor_parallel={
        "embed_in": meshlm.VOCAB_EMBEDDING,
        "layers.*.attention.query_key_value": meshlm.InterleavedColwise(per_head=3),
        "layers.*.attention.dense": meshlm.ROWWISE,
        "layers.*.dense_h_to_4h": meshlm.COLWISE,
        "layers.*.dense_4h_to_h": meshlm.ROWWISE,
        "embed_out": meshlm.VOCAB_HEAD,
    },
    zero3_units=("layers.*",),
    head_dim=lambda model: model.layers[0].attention.head_dim,
)


def gpt2() -> nn.Module:
    return GPT2(vocab=VOCAB, dim=DIM, n_layers=2, n_heads=4, max_len=SEQ)


MODELS = {"gpt2": (gpt2, GPT2_PLAN), "phi3": (Phi3, PHI3_PLAN), "neox": (NeoX, NEOX_PLAN)}
# The mutation: GPT-2's c_attn split as a plain colwise (rank 0 holds [all Q], rank 1 [all K | all V] halves).
MUTANT_PLAN = meshlm.ParallelPlan(
    **{**vars(GPT2_PLAN), "tensor_parallel": {**GPT2_PLAN.tensor_parallel, "h.*.attn.c_attn": meshlm.COLWISE}}
)


def run(
    layout: str, model: str, optimizer: str = "adamw", plan: meshlm.ParallelPlan | None = None, **parallel: object
) -> dict:
    """A user loop through meshlm.parallelize: {'losses', 'grad_norms', 'state', 'optimizer', 'updates', 'moved'}."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model_fn, default_plan = MODELS[model]
    mesh = build_mesh(parse_layout(layout, world), "cpu")
    torch.manual_seed(0)
    module = model_fn()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    pm = meshlm.parallelize(module, mesh, parallel, plan=plan or default_plan)
    if optimizer == "sgd":
        opt = torch.optim.SGD(pm.parameters(), lr=0.2)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, eps=1e-6)
    losses, norms = [], []
    steps = SGD_STEPS if optimizer == "sgd" else STEPS
    for step in range(steps):
        x, y = global_batch(step, BATCH, SEQ, VOCAB)
        losses.append(pm.forward_backward(pm.local_batch(x), pm.local_batch(y)).item())
        norms.append(pm.clip_grad_norm_(1.0).item())
        pm.step(opt)
    state = pm.full_state_dict()
    moved = {k: (v - initial[k]).abs().max().item() for k, v in state.items()}
    return {"losses": losses, "grad_norms": norms, "state": state, "optimizer": optimizer, "updates": steps,
            "moved": moved}  # fmt: skip


WORLD2 = [
    ("tp=2", "gpt2", "sgd", {}),
    ("tp=2", "phi3", "adamw", {"sequence_parallel": True}),
    ("tp=2", "phi3", "sgd", {}),
    ("tp=2", "neox", "adamw", {}),
    ("tp=2", "neox", "sgd", {}),
]
WORLD4 = [
    ("dp=2,tp=2", "gpt2", "adamw", {"zero": 3}),
    ("dp=2,tp=2", "gpt2", "sgd", {"zero": 3}),
    ("dp=2,tp=2", "phi3", "adamw", {"zero": 1, "sequence_parallel": True}),
    ("dp=2,tp=2", "phi3", "sgd", {"zero": 3}),
    ("dp=2,tp=2", "neox", "adamw", {"zero": 1}),
    ("dp=2,tp=2", "neox", "sgd", {"zero": 3}),
]


def _gpt2_tp2() -> dict:
    try:
        mutant = run("tp=2", "gpt2", plan=MUTANT_PLAN)
    except meshlm.PlanError as e:  # refused by the build-time probe (tests/parallel/test_silent_cases.py)
        mutant = str(e)
    return {"run": run("tp=2", "gpt2"), "mutant": mutant}


def _world2() -> dict:
    return {"runs": [run(layout, model, opt, **par) for layout, model, opt, par in WORLD2]}


def _world4(run_dir: str) -> dict:
    runs = [run(layout, model, opt, **par) for layout, model, opt, par in WORLD4]
    # Checkpoint and meta materialisation of the fused shards, dp=2×tp=2 ZeRO-3.
    mesh = build_mesh(parse_layout("dp=2,tp=2", 4), "cpu")
    torch.manual_seed(0)
    pm = meshlm.parallelize(Phi3(), mesh, {"zero": 3}, plan=PHI3_PLAN)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    x, y = global_batch(0, BATCH, SEQ, VOCAB)
    pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
    pm.step(opt)
    saves = meshlm.Checkpoints(run_dir, async_save=False)
    saves.save(1, pm, opt)
    saves.wait()
    with torch.device("meta"):
        meta = Phi3(init_seed=0)
    start = meshlm.parallelize(meta, mesh, {"zero": 3}, plan=PHI3_PLAN).full_state_dict()
    return {"runs": runs, "saved": pm.full_state_dict(), "meta_start": start}


def _check(cases: list, results: list[dict], references: dict) -> None:
    for rank, result in enumerate(results):
        for (layout, model, opt, par), got in zip(cases, result["runs"], strict=True):
            try:
                assert_close_runs(references[(model, opt)], got)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} {layout} {model} {opt} {par}: {e}") from None


def test_gpt2_fused_c_attn_under_tp_matches_one_process_and_a_plain_colwise_does_not() -> None:
    ref = run("", "gpt2")
    for rank, got in enumerate(run_shared(_gpt2_tp2, 2)):
        try:
            assert_close_runs(ref, got["run"])
        except AssertionError as e:
            raise AssertionError(f"rank {rank}: {e}") from None
        # The same c_attn split as a plain colwise would train another model: refused before step 1.
        assert "module h.0.attn.c_attn (colwise) does not match its weight's row order" in got["mutant"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]  # runs that learn


def test_fused_projections_under_tp_match_one_process() -> None:
    references = {(m, o): run("", m, o) for _, m, o, _ in WORLD2}
    _check(WORLD2, run_shared(_world2, 2), references)
    for model in ("phi3", "neox"):  # runs that learn
        losses = references[(model, "adamw")]["losses"]
        assert losses[-1] < losses[0] - 0.3, (model, losses)


@pytest.mark.slow  # six runs, a checkpoint and a meta start on four fresh ranks: 18 s on the 2-core VM
def test_fused_projections_under_dp_tp_zero_match_one_process(tmp_path: Path) -> None:
    references = {(m, o): run("", m, o) for _, m, o, _ in WORLD4}
    results = run_distributed(_world4, 4, str(tmp_path))
    _check(WORLD4, results, references)
    # The checkpoint written from fused shards loads at world 1 as the weights that were saved.
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = build_mesh(parse_layout("", 1), "cpu")
    pm = meshlm.parallelize(Phi3(init_seed=5), mesh, plan=PHI3_PLAN)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    meshlm.Checkpoints(tmp_path, async_save=False).load_latest(pm, opt)
    assert_identical_weights(results[0]["saved"], pm.full_state_dict())
    # Meta-built with an init_rule: the fused shards materialise to the one-process weights.
    assert_identical_weights(Phi3(init_seed=0).state_dict(), results[0]["meta_start"])


# ---- refused plans ---------------------------------------------------------------------------------------
def _plan(style: object) -> meshlm.ParallelPlan:
    return meshlm.ParallelPlan(**{**vars(PHI3_PLAN), "tensor_parallel": {"layers.*.self_attn.qkv_proj": style}})


BAD_BLOCKS = [
    (2, meshlm.FusedColwise((32, 16, 8)), r"blocks \[32, 16, 8\] must sum to out_features 64"),
    (2, meshlm.FusedColwise((32, 16, 16), heads=True), None),  # valid
    (4, meshlm.FusedColwise((32, 16, 16), heads=True), r"whole heads of 8, each block's head count divisible by tp=4"),
    (3, meshlm.FusedColwise(2), r"blocks \[32, 32\] .* each divisible by tp=3"),
    (2, meshlm.InterleavedColwise(per_head=3), r"64 outputs = 2\.66667 heads of 3×8"),
    (2, "fused", r"style 'fused'.*valid: colwise.*FusedColwise\(blocks\)"),
]


@pytest.mark.parametrize(("tp", "style", "message"), BAD_BLOCKS)
def test_wrong_block_spec_is_one_line(tp: int, style: object, message: str | None) -> None:
    model = Phi3()
    if message is None:
        check_tp_plan(model, _plan(style), tp, False)
        return
    with pytest.raises(meshlm.PlanError) as err:
        check_tp_plan(model, _plan(style), tp, False)
    assert re.search(message, str(err.value)) and "\n" not in str(err.value), str(err.value)
    assert "layers.0.self_attn.qkv_proj" in str(err.value) or "style" in str(err.value)
