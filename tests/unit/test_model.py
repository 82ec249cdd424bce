"""The plain model: shapes, parameter and FLOP formulas, causality, GQA and activation checkpointing."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshlm.model import PRESETS, ModelConfig, Transformer, cross_entropy_loss, flops_per_token, generate, param_counts
from meshlm.model.flops import matmul_params

SMALL = PRESETS["test"]


@pytest.mark.parametrize("name", ["tiny", "test"])
def test_param_count_formula_matches_built_model(name: str) -> None:
    cfg = PRESETS[name]
    assert Transformer(cfg).num_params() == param_counts(cfg)["total"]


def test_param_count_tied_embeddings() -> None:
    cfg = SMALL.replace(tie_embeddings=True)
    model = Transformer(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.num_params() == param_counts(cfg)["total"] == param_counts(SMALL)["total"] - cfg.vocab_size * cfg.dim


def test_llama3_8b_shape_is_eight_billion() -> None:
    total = param_counts(PRESETS["llama3-8b"])["total"]
    assert 8.0e9 < total < 8.1e9  # Meta reports 8.03B


def test_flops_per_token_by_hand() -> None:
    cfg = ModelConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=12, max_seq_len=16)
    # per layer: q 8·8, k 8·4, v 8·4, o 8·8 = 192; mlp 3·8·12 = 288; head 100·8 = 800
    assert matmul_params(cfg) == 2 * (192 + 288) + 800
    forward = 2 * (2 * (192 + 288) + 800) + 4 * 2 * 16 * 8
    assert flops_per_token(cfg, seq_len=16) == 3 * forward
    assert flops_per_token(cfg, seq_len=16, training=False) == forward


def test_flops_close_to_six_n_for_large_models() -> None:
    cfg = PRESETS["llama3-70b"]
    n = param_counts(cfg)["total"] - cfg.vocab_size * cfg.dim  # without the embedding lookup
    assert flops_per_token(cfg, 2048) / (6 * n) == pytest.approx(1.0, rel=0.05)


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, SMALL.vocab_size)
    assert cross_entropy_loss(logits, x).item() == pytest.approx(math.log(SMALL.vocab_size), rel=0.05)


def test_causal_future_tokens_do_not_change_the_past() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % SMALL.vocab_size
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
    assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


def test_grouped_query_attention_equals_repeated_kv_heads() -> None:
    """A GQA model equals the MHA model whose K/V projections repeat each KV head for its query group."""
    torch.manual_seed(0)
    gqa = Transformer(SMALL)
    mha_cfg = SMALL.replace(n_kv_heads=SMALL.n_heads)
    mha = Transformer(mha_cfg)
    state = gqa.state_dict()
    group, hd = SMALL.n_heads // SMALL.n_kv_heads, SMALL.head_dim
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[key].view(SMALL.n_kv_heads, hd, SMALL.dim)
            state[key] = w.repeat_interleave(group, dim=0).reshape(-1, SMALL.dim)
    mha.load_state_dict(state)
    x = torch.randint(0, SMALL.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_rotary_makes_attention_position_dependent() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (1, 8))
    shifted = torch.cat([x[:, :1], x], dim=1)
    assert not torch.allclose(model(x)[:, -1], model(shifted)[:, -1], atol=1e-4)


def test_activation_checkpointing_gives_identical_gradients() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (2, 16))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        cross_entropy_loss(model(x), x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def test_sequence_longer_than_max_is_rejected() -> None:
    model = Transformer(SMALL)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))


def test_greedy_generation_is_deterministic_and_extends_prompt() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, 5, temperature=0)
    b = generate(model, prompt, 5, temperature=0)
    assert a.shape == (1, 8) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    expected_next = model(prompt)[:, -1].argmax(-1)
    assert a[0, 3] == expected_next[0]


def test_generation_stops_at_the_stop_token() -> None:
    """A row that samples the stop token keeps it; sampling ends when every row has (greedy: the token the
    model picks first is made the stop token, so row 0 ends at once, row 1 later or never)."""
    torch.manual_seed(0)
    model = Transformer(SMALL)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = generate(model, prompt, 6, temperature=0)
    stop = int(free[0, 3])
    out = generate(model, prompt, 6, temperature=0, stop_token=stop)
    assert torch.equal(out[0, 3:], torch.full_like(out[0, 3:], stop))
    row1 = free[1, 3:].tolist()
    ends = row1.index(stop) + 1 if stop in row1 else 6
    assert out.shape[1] == 3 + ends and out[1, 3:].tolist() == row1[:ends]


def test_cross_entropy_matches_torch() -> None:
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    assert cross_entropy_loss(logits, targets).item() == pytest.approx(
        F.cross_entropy(logits.view(-1, 7), targets.view(-1)).item()
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"dim": 65}, "n_heads"), ({"n_kv_heads": 3}, "n_kv_heads"), ({"n_layers": 0}, "n_layers")],
)
def test_invalid_shapes_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SMALL.replace(**changes)
