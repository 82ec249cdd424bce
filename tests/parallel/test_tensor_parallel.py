"""Tensor and sequence parallelism: the collectives, the sharded layers, gradients, training equivalence
with the single-process model (tp = 2, 4; ± sequence parallel; tied embeddings; accumulation; with dp and
ZeRO), generation, activation memory and the one-line layout errors.

Each distributed test runs many checks as one call on a gloo group shared with the other tests of its world
size. Training equivalence follows tests/equivalence.py: AdamW loss curves, SGD final weights, and a
mutation per world size (a real bug injected) that every criterion must catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_shared
from equivalence import (
    TEST_MODEL,
    assert_close_runs,
    assert_mutations_caught,
    global_batch,
    reference,
    train_layout,
    train_mutated,
)
from torch import nn

from meshlm.model import ModelConfig, Transformer, cross_entropy_loss, generate
from meshlm.parallel.mesh import LayoutError
from meshlm.parallel.placement import Placements, unshard
from meshlm.parallel.tp.ops import (
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_to_tp,
)
from meshlm.parallel.tp.sharding import (
    apply_tensor_parallel,
    gathered_logits,
    vocab_parallel_cross_entropy,
)
from meshlm.parallel.tp.sizes import check_tensor_parallel

TIED = TEST_MODEL.replace(tie_embeddings=True)
SP = {"sequence_parallel": True}
PROMPT_LEN, NEW_TOKENS = 5, 12  # an odd prompt: generation must not need seq_len % tp == 0


# ---- helpers run on every rank ---------------------------------------------------------------------
def _per_rank(seed: int, shape: tuple[int, ...], world: int) -> list[torch.Tensor]:
    """Every rank's input, computable on any rank (so each can build the expected result)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _check_primitives() -> None:
    """Forward and backward of every conjugate pair against what the collectives must compute."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    xs, gs = _per_rank(1, (2, 4, 6), world), _per_rank(2, (2, 4, 6), world)
    full_last, full_seq = torch.cat(xs, -1), torch.cat(xs, 1)

    def run(op, x, grad):
        x = x.clone().requires_grad_()
        y = op(x, group)
        y.backward(grad)
        return y.detach(), x.grad

    y, g = run(copy_to_tp, xs[0], gs[rank])
    assert torch.equal(y, xs[0]) and torch.allclose(g, sum(gs))
    y, g = run(reduce_from_tp, xs[rank], gs[0])
    assert torch.allclose(y, sum(xs)) and torch.equal(g, gs[0])
    y, g = run(gather_from_tp, xs[rank], torch.cat(gs, -1))
    assert torch.equal(y, full_last) and torch.equal(g, gs[rank])
    y, g = run(scatter_to_tp, full_last, gs[rank])
    assert torch.equal(y, xs[rank]) and torch.equal(g, torch.cat(gs, -1))
    # Sequence ops: each rank's upstream gradient of the full sequence is partial, the sum is the gradient.
    partial = [torch.cat(_per_rank(10 + r, (2, 4, 6), world), 1) for r in range(world)]
    y, g = run(gather_seq, xs[rank], partial[rank])
    assert torch.equal(y, full_seq) and torch.allclose(g, sum(partial).chunk(world, 1)[rank])
    y, g = run(reduce_scatter_seq, partial[rank], gs[rank])
    assert torch.allclose(y, sum(partial).chunk(world, 1)[rank]) and torch.equal(g, torch.cat(gs, 1))


def _check_cross_entropy() -> None:
    """vocab_parallel_cross_entropy == F.cross_entropy(reduction="none", ignore_index=-100) on the gathered
    logits, per token in value and gradient (an upstream gradient per token, as a global-batch mean weighs
    them), including logits large enough to overflow exp() without the max shift, with a third of the targets
    -100: those get loss 0 and no gradient. The mutation (-100 treated as a vocabulary id of no rank, but
    still counted) must differ, so the comparison is sharp."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    g = torch.Generator().manual_seed(3)
    vocab = 16 * world
    for scale in (1.0, 200.0):
        logits = torch.randn(3, 5, vocab, generator=g) * scale
        targets = torch.randint(0, vocab, (3, 5), generator=g)
        targets[torch.rand(3, 5, generator=g) < 0.33] = -100
        upstream = torch.rand(3, 5, generator=g)
        ref_logits = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1), reduction="none").view(3, 5)
        ref.backward(upstream)
        local = logits.chunk(world, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, group)
        loss.backward(upstream)
        assert loss.shape == targets.shape and torch.isfinite(loss).all()
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local.grad, ref_logits.grad.chunk(world, -1)[rank], rtol=1e-5, atol=1e-7)
        if scale == 1.0:  # -100 not ignored: log Σexp counted as the token's loss (≈ 0 at scale 200)
            unmasked = vocab_parallel_cross_entropy(local.detach(), targets, group, ignore_index=-1)
            assert (unmasked - ref).abs().max() > 0.1


def _check_embedding() -> None:
    """VocabParallelEmbedding == nn.Embedding (output and weight gradient), replicated and under SP."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    cfg = TEST_MODEL
    ids, _ = global_batch(0, 2, 8, cfg.vocab_size)
    upstream = torch.randn(2, 8, cfg.dim, generator=torch.Generator().manual_seed(4))
    for sp in (False, True):
        torch.manual_seed(0)
        ref_model, model = Transformer(cfg), Transformer(cfg)
        model.load_state_dict(ref_model.state_dict())
        ref_embed: nn.Embedding = ref_model.model.embed_tokens
        ref_out = ref_embed(ids)
        ref_out.backward(upstream)
        apply_tensor_parallel(model, group, Placements(), sequence_parallel=sp)
        out = model.model.embed_tokens(ids)
        grad = upstream.chunk(world, 1)[rank] if sp else upstream
        out.backward(grad)
        want = ref_out.detach().chunk(world, 1)[rank] if sp else ref_out.detach()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        rows = cfg.vocab_size // world
        shard_grad = ref_embed.weight.grad[rank * rows : (rank + 1) * rows]
        torch.testing.assert_close(model.model.embed_tokens.weight.grad, shard_grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="sequence length 7 is not divisible"):
        model.model.embed_tokens(ids[:, :7])  # the run-time guard behind check_tensor_parallel


def _check_gradients(cfg: ModelConfig, sp: bool, checkpointing: bool) -> None:
    """One forward/backward of the sharded model: every gathered .grad equals the single-process one
    when backward returns (norm weights under SP, replicated KV heads, tied embeddings included)."""
    group = dist.group.WORLD
    x, y = global_batch(0, 4, 32, cfg.vocab_size)
    torch.manual_seed(0)
    ref = Transformer(cfg)
    cross_entropy_loss(ref(x), y).backward()
    torch.manual_seed(0)
    model = Transformer(cfg)
    placements = Placements()
    apply_tensor_parallel(model, group, placements, sequence_parallel=sp)
    model.activation_checkpointing = checkpointing
    vocab_parallel_cross_entropy(model(x), y, group).mean().backward()
    grads = unshard({n: p.grad for n, p in model.named_parameters()}, model, placements, "tp", group)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=2e-7, msg=lambda m, n=name: f"{n}: {m}")


def _saved_block_bytes(model: Transformer, x: torch.Tensor) -> int:
    """Bytes of the unique storages block 0 saves for backward, parameters and rotary tables excluded."""
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers["0"](x, model.rope_cos, model.rope_sin)
    return sum(saved.values())


def block_activation_bytes(cfg: ModelConfig, batch: int, seq: int, tp: int, sp: bool) -> float:
    """The fp32 formula of docs/tensor_parallel.md: per token, (6d+2)/t_sp for the two norms,
    (2d+a)/t + 2·⌈kv/t⌉·head_dim for attention, 4·I/t for the SwiGLU MLP."""
    t_sp = tp if sp else 1
    kv_local = -(-cfg.n_kv_heads // tp)
    per_token = (
        (6 * cfg.dim + 2) / t_sp
        + (2 * cfg.dim + cfg.n_heads) / tp
        + 2 * kv_local * cfg.head_dim
        + 4 * cfg.intermediate_size / tp
    )
    return 4 * batch * seq * per_token


def _activation_bytes(batch: int = 2, seq: int = 32) -> dict[str, int]:
    """Saved bytes of one block: single-process, tp, tp + SP (this rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(batch, seq, TEST_MODEL.dim, generator=torch.Generator().manual_seed(5))
    out = {}
    for name, sp in (("single", None), ("tp", False), ("tp_sp", True)):
        torch.manual_seed(0)
        model = Transformer(TEST_MODEL)
        if sp is not None:
            apply_tensor_parallel(model, dist.group.WORLD, Placements(), sequence_parallel=sp)
        block_input = x.chunk(world, 1)[rank] if sp else x
        out[name] = _saved_block_bytes(model, block_input.clone().requires_grad_())
    return out


def _generate_both_ways(state: dict[str, torch.Tensor], cfg: ModelConfig, prompt: torch.Tensor) -> dict:
    """Greedy tokens from the gathered weights on one rank, and from the tp-sharded model on all ranks."""
    full = Transformer(cfg)
    full.load_state_dict(state)
    sharded = Transformer(cfg)
    sharded.load_state_dict(state)
    apply_tensor_parallel(sharded, dist.group.WORLD, Placements(), sequence_parallel=True)
    with gathered_logits(sharded):
        from_shards = generate(sharded, prompt, NEW_TOKENS, temperature=0)
    return {"full": generate(full, prompt, NEW_TOKENS, temperature=0), "sharded": from_shards}


def _train_runs(runs: list[tuple[str, dict, dict]]) -> list[dict]:
    return [train_layout(layout, parallel, **kwargs) for layout, parallel, kwargs in runs]


def with_sgd_twins(runs: list[tuple[str, dict, dict]]) -> list[tuple[str, dict, dict]]:
    """Each AdamW run (its loss curve is the criterion) and its SGD twin (loss curve and final weights)."""
    return [*runs, *[(layout, par, {**kwargs, "optimizer": "sgd"}) for layout, par, kwargs in runs]]


def _ops_checks() -> dict:
    _check_primitives()
    _check_cross_entropy()
    _check_embedding()
    _check_gradients(TEST_MODEL, sp=False, checkpointing=False)
    _check_gradients(TIED, sp=True, checkpointing=True)
    return _activation_bytes()


def _tp2_checks(runs: list[tuple[str, dict, dict]], prompt: torch.Tensor, mutated: list) -> dict:
    results = _train_runs(runs)
    # Generation from the tp=2 + SP model trained with SGD (weights equal to the reference's to an ulp).
    sgd_sp = next(r for (_, par, kw), r in zip(runs, results, strict=True) if par == SP and kw == {"optimizer": "sgd"})
    return {
        "runs": results,
        "generated": _generate_both_ways(sgd_sp["state"], TEST_MODEL, prompt),
        "mutated": train_mutated("tp input gradient not all-reduced", mutated),
    }


def _tp4_checks(runs: list[tuple[str, dict, dict]], mutated: list) -> dict:
    _check_gradients(TEST_MODEL, sp=True, checkpointing=False)  # n_kv_heads 2 < tp 4: replicated KV
    return {
        "runs": _train_runs(runs),
        "activations": _activation_bytes(),
        "mutated": train_mutated("kv head summed on one rank only", mutated),
    }


# ---- the single-process references (shared with other modules, computed once per session) ----------
REFERENCE_CASES = {"plain": {}, "tied": {"model_cfg": TIED}, "accum": {"micro_batch": 2}}


def _reference_for(kwargs: dict) -> dict:
    """The single-process run a layout's run is compared with: same model, accumulation and optimizer."""
    return reference(**{k: v for k, v in kwargs.items() if k in ("model_cfg", "micro_batch", "optimizer")})


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return global_batch(100, 2, PROMPT_LEN, TEST_MODEL.vocab_size)[0]


@pytest.fixture(scope="module")
def reference_generated(prompt: torch.Tensor) -> torch.Tensor:
    model = Transformer(TEST_MODEL)
    model.load_state_dict(reference(optimizer="sgd")["state"])
    return generate(model, prompt, NEW_TOKENS, temperature=0)


def _assert_matches(ref: dict, got: dict, label: str) -> None:
    try:
        assert_close_runs(ref, got)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def _assert_runs_match(runs: list[tuple[str, dict, dict]], per_rank: list[list[dict]]) -> None:
    for rank, results in enumerate(per_rank):
        for (layout, par, kwargs), got in zip(runs, results, strict=True):
            _assert_matches(_reference_for(kwargs), got, f"rank {rank} {layout} {par} {kwargs}")


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cfg", "tp", "seq_len", "sp", "field"),
    [
        (ModelConfig(dim=96, n_heads=6, n_kv_heads=2, vocab_size=256, intermediate_size=128), 4, 32, False, "n_heads"),
        (ModelConfig(dim=96, n_heads=12, n_kv_heads=3, vocab_size=256, intermediate_size=128), 4, 32, False, "kv"),
        (TEST_MODEL.replace(intermediate_size=130), 4, 32, False, "intermediate_size"),
        (TEST_MODEL.replace(vocab_size=250), 4, 32, False, "vocab_size"),
        (TEST_MODEL, 4, 30, True, "seq_len"),
    ],
)
def test_layout_errors_are_one_line(cfg: ModelConfig, tp: int, seq_len: int, sp: bool, field: str) -> None:
    """Raised from the shapes alone (no process group), as one line naming the field."""
    with pytest.raises(LayoutError, match=field) as err:
        check_tensor_parallel(cfg, tp, seq_len, sp)
    assert "\n" not in str(err.value)
    check_tensor_parallel(cfg, 1, seq_len, sp)  # the same model is fine without tp


def test_sequence_length_only_matters_under_sequence_parallel() -> None:
    check_tensor_parallel(TEST_MODEL, 4, 30, sequence_parallel=False)
    check_tensor_parallel(TEST_MODEL, 4, 32, sequence_parallel=True)  # n_kv_heads 2 < tp 4 is allowed


def test_ops_gradients_and_activation_memory() -> None:
    """Collectives, vocab-parallel CE and embedding, whole-model gradients (± SP, checkpointing, tied),
    and the per-rank activation bytes of one block against the documented formula (tp=2)."""
    act = run_shared(_ops_checks, 2)[0]
    for name, tp, sp in (("single", 1, False), ("tp", 2, False), ("tp_sp", 2, True)):
        assert act[name] == block_activation_bytes(TEST_MODEL, 2, 32, tp, sp), (name, act)
    assert act["single"] / act["tp_sp"] == pytest.approx(2.0)  # SP: everything in the block falls by tp
    assert act["single"] / act["tp"] < 1.6  # without SP the norms and region inputs stay replicated


MUTATED_TP2 = [("tp=2", {}, {}), ("tp=2", {}, {"optimizer": "sgd"})]  # f is the op SP replaces


@pytest.mark.slow  # ~5,600 two-rank collectives: ~12 s
def test_tp2_matches_single_process(prompt: torch.Tensor, reference_generated: torch.Tensor) -> None:
    """Plain, SP, tied, accumulation: AdamW loss curves and SGD final weights; the greedy tokens of the
    SGD-trained tp=2 + SP model, from its gathered weights and from its shards. A missing all-reduce in
    Megatron's f operator fails every criterion."""
    runs = with_sgd_twins(
        [("tp=2", {}, {}), ("tp=2", SP, {}), ("tp=2", SP, {"model_cfg": TIED}), ("tp=2", SP, {"micro_batch": 2})]
    )
    out = run_shared(_tp2_checks, 2, runs, prompt, MUTATED_TP2)
    _assert_runs_match(runs, [result["runs"] for result in out])
    for rank, result in enumerate(out):
        for how, tokens in result["generated"].items():
            assert torch.equal(tokens, reference_generated), (rank, how, tokens, reference_generated)
    refs = [_reference_for(kwargs) for _, _, kwargs in MUTATED_TP2]
    assert_mutations_caught(refs, [result["mutated"] for result in out], [str(run) for run in MUTATED_TP2])


MUTATED_TP4 = [("tp=4", {}, {}), ("tp=4", {}, {"optimizer": "sgd"})]


@pytest.mark.slow  # ~2,000 four-rank collectives (~6 ms each here): ~15 s
def test_tp4_replicated_kv_matches_single_process() -> None:
    """n_kv_heads 2 < tp 4: each KV head lives on two ranks and its gradient is summed over them; summing it
    on one of them only fails every criterion."""
    runs = with_sgd_twins([("tp=4", {}, {}), ("tp=4", SP, {})])
    out = run_shared(_tp4_checks, 4, runs, MUTATED_TP4)
    _assert_runs_match(runs, [result["runs"] for result in out])
    for result in out:
        act = result["activations"]
        for name, tp, sp in (("single", 1, False), ("tp", 4, False), ("tp_sp", 4, True)):
            assert act[name] == block_activation_bytes(TEST_MODEL, 2, 32, tp, sp), (name, act)
        # Not quite 4: each rank still holds a whole KV head (2 heads over 4 ranks).
        assert 3.6 < act["single"] / act["tp_sp"] < 4
    refs = [_reference_for(kwargs) for _, _, kwargs in MUTATED_TP4]
    assert_mutations_caught(refs, [result["mutated"] for result in out], [str(run) for run in MUTATED_TP4])


# dp+tp is in the fast tier's tests/parallel/test_compositions.py
@pytest.mark.slow  # ZeRO 0-3 × SGD twins, eight four-rank runs
def test_dp2_tp2_with_zero_matches_single_process() -> None:
    pytest.importorskip("meshlm.parallel.dp.data_parallel")
    runs = with_sgd_twins([("dp=2,tp=2", {"zero": zero, **(SP if zero % 2 else {})}, {}) for zero in range(4)])
    _assert_runs_match(runs, run_shared(_train_runs, 4, runs))
