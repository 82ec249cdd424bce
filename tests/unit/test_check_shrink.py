"""meshlm.check.shrink: a run's replica keeps its structure and layout features at the smallest sizes that meshlm's
own checks accept for the mapped layout (each dimension > 1 at 2), and starts from a sliced copy of init_from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshlm.check.shrink import Replica, ShrinkError, map_layout, shrink
from meshlm.config import Config, load_config
from meshlm.convert import load_checkpoint_model
from meshlm.errors import InputError
from meshlm.model.hf import import_hf, load_hf_into_model
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import Layout, parse_layout
from meshlm.parallel.strategies import check_layout
from meshlm.train.trainer import check_config, fit

LLAMA_70B_RUN = [
    ("model.preset", "llama3-70b"),
    ("parallel.layout", "pp=4,dp=8,tp=8"),
    ("parallel.schedule", "interleaved"),
    ("parallel.virtual_stages", 2),
    ("parallel.zero", 1),
    ("parallel.sequence_parallel", True),
    ("train.global_batch", 512),
    ("train.micro_batch", 1),
    ("train.fp8", True),
    ("data.seq_len", 8192),
]


def run(overrides: list[tuple[str, object]], tmp_path: Path, **kwargs: object) -> tuple[Config, Replica]:
    cfg = load_config(None, overrides)
    return cfg, shrink(cfg, tmp_path, **kwargs)


def micro_batches(cfg: Config) -> int:
    """Micro-batches per replica of a config at its own layout (meshlm's layout check computes them)."""
    layout = parse_layout(cfg.parallel.layout, parse_world(cfg.parallel.layout))
    return check_config(cfg, layout.world_size)[1]


def parse_world(text: str) -> int:
    world = 1
    for part in text.split(","):
        world *= int(part.split("=")[1])
    return world


def test_llama3_70b_maps_to_pp2_dp2_tp2_keeping_its_structure(tmp_path: Path) -> None:
    cfg, replica = run(LLAMA_70B_RUN, tmp_path)
    small, par, train = replica.config.model.build(), replica.config.parallel, replica.config.train
    assert replica.target_layout == "pp=4,dp=8,tp=8"
    assert par.layout == "pp=2,dp=2,tp=2"
    assert (par.schedule, par.virtual_stages, par.zero, par.sequence_parallel) == ("interleaved", 2, 1, True)
    assert small.n_heads // small.n_kv_heads == 8  # GQA 8:1
    assert small.n_kv_heads % 2 == 0  # KV heads still split over tp, not replicated
    assert (small.head_dim_override, small.head_dim * small.n_heads) == (0, small.dim)  # head_dim = dim / n_heads
    assert small.tie_embeddings is False and small.rope_theta == 500000.0
    assert (small.dim, small.n_layers, small.n_heads, small.intermediate_size) == (64, 4, 16, 224)
    assert small.vocab_size == 258  # the byte-level tokenizer's 257, rounded up to a multiple of tp
    assert replica.config.data.seq_len == 64
    assert micro_batches(replica.config) == micro_batches(cfg) == 64  # accumulation kept, rows per micro-batch 1
    assert (train.device, train.dtype, train.compile, train.fp8) == ("cpu", "fp32", False, False)
    assert replica.config.log.run_dir == str(tmp_path / "run")
    assert {"GQA 8:1", "schedule interleaved x2", "ZeRO-1", "sequence parallel"} <= set(replica.kept)
    assert {"hidden 8192 -> 64", "layers 80 -> 4", "layout pp=4,dp=8,tp=8 -> pp=2,dp=2,tp=2"} <= set(replica.shrunk)
    assert "fp8 -> off (CPU)" in replica.shrunk


def test_sizes_are_the_smallest_the_mapped_layout_accepts(tmp_path: Path) -> None:
    """One fewer KV head pair, layer or vocabulary entry than the replica has breaks the mapped layout's checks
    or the kept structure: the search stops at the first size that fits."""
    _, replica = run(LLAMA_70B_RUN, tmp_path)
    small, par, train = replica.config.model.build(), replica.config.parallel, replica.config.train
    layout = parse_layout(par.layout, 8)

    def fits(**changes: int) -> bool:
        try:
            spec = LayoutSpec(
                small.replace(**changes), layout, train.global_batch, train.micro_batch, replica.config.data.seq_len,
                par.options(),
            )  # fmt: skip
            check_layout(spec)
        except ValueError:
            return False
        return True

    assert fits()
    assert not fits(n_layers=small.n_layers - 1)  # pp×virtual_stages = 4 chunks need 4 layers
    assert not fits(vocab_size=small.vocab_size - 1)  # 257 is not divisible by tp=2
    assert not fits(intermediate_size=small.intermediate_size - 1)
    # One KV head would fit meshlm (replicated over tp=2), but the run splits its 8 over tp=8: the smallest
    # split count at tp=2 is 2.
    assert small.n_kv_heads == 2 and fits(n_kv_heads=1, n_heads=8, dim=8 * small.head_dim)


def test_tied_embeddings_are_kept(tmp_path: Path) -> None:
    _, replica = run([("model.preset", "llama3-1b"), ("parallel.layout", "dp=4,tp=4")], tmp_path)
    assert replica.config.model.build().tie_embeddings is True
    assert "tied embeddings" in replica.kept and replica.config.parallel.layout == "pp=1,dp=2,tp=2"


def test_moe_with_ep_keeps_routing_and_splits_experts(tmp_path: Path) -> None:
    overrides = [
        ("model.preset", "qwen3-30b-a3b"),
        ("parallel.layout", "dp=4,ep=8,tp=2"),
        ("train.global_batch", 64),
        ("data.seq_len", 4096),
    ]
    _, replica = run(overrides, tmp_path)
    small = replica.config.model.build()
    assert replica.config.parallel.layout == "pp=1,dp=2,ep=2,tp=2"
    assert (small.hf_model_type, small.qk_norm, small.norm_topk, small.top_k) == ("qwen3_moe", True, True, 8)
    assert small.top_k < small.n_experts and small.n_experts % 2 == 0  # routing chooses; experts split over ep
    assert small.n_experts // 2 > 1  # each ep rank keeps several experts, as each of the run's 8 does
    assert small.n_experts == 10 and small.n_experts < 128
    assert small.head_dim_override == small.head_dim > small.dim // small.n_heads  # Qwen3's wide heads
    assert small.moe_intermediate_size % 2 == 0 and small.moe_intermediate_size < small.intermediate_size


def test_moe_shared_expert_and_dense_first_layer_are_kept(tmp_path: Path) -> None:
    overrides = [("model.preset", "tiny-moe"), ("parallel.layout", "pp=2,dp=2,ep=2"), ("train.micro_batch", 2)]
    _, replica = run(overrides, tmp_path)
    small = replica.config.model.build()
    assert (small.shared_expert_gate, small.qkv_bias, small.first_k_dense) == (True, True, 1)
    assert small.moe_layers == tuple(range(1, small.n_layers)) and small.n_layers >= 2
    assert small.shared_expert_intermediate_size > 0 and small.top_k == 2 < small.n_experts
    assert {"shared expert (gated)", "q/k/v biases"} <= set(replica.kept)


@pytest.mark.parametrize(("attention", "heads_split"), [("ring", 2), ("ulysses", 4)])
def test_context_parallel_keeps_attention_and_splits_the_sequence(
    attention: str, heads_split: int, tmp_path: Path
) -> None:
    overrides = [
        ("model.preset", "llama3-8b"),
        ("parallel.layout", "cp=4,tp=8" if attention == "ring" else "cp=4,tp=2"),
        ("parallel.cp_attention", attention),
        ("parallel.sequence_parallel", attention == "ring"),
        ("data.seq_len", 8192),
        ("train.global_batch", 8),
    ]
    _, replica = run(overrides, tmp_path)
    small, seq_len = replica.config.model.build(), replica.config.data.seq_len
    assert replica.config.parallel.layout == "pp=1,dp=1,cp=2,tp=2"
    assert replica.config.parallel.cp_attention == attention and seq_len == 64
    assert seq_len % 4 == 0  # 2·cp load-balanced ring chunks (and cp×tp under SP)
    assert small.n_kv_heads % heads_split == 0  # Ulysses splits the heads over cp×tp
    assert f"cp attention {attention}" in replica.kept


def test_lora_and_freeze_are_kept(tmp_path: Path) -> None:
    overrides = [
        ("model.preset", "llama3-8b"),
        ("parallel.layout", "pp=2,dp=2,tp=2"),
        ("parallel.zero", 3),
        ("lora.rank", 16),
        ("lora.targets", ["model.layers.*.self_attn.[qv]_proj"]),
        ("train.freeze", ["model.embed_tokens.*"]),
        ("train.global_batch", 8),
        ("train.micro_batch", 1),
        ("data.seq_len", 2048),
    ]
    cfg, replica = run(overrides, tmp_path)
    assert replica.config.data.seq_len == 64
    lora = replica.config.lora
    assert (lora.targets, lora.dropout, replica.config.train.freeze) == (cfg.lora.targets, 0.0, cfg.train.freeze)
    assert replica.config.parallel.zero == 3
    assert "LoRA rank 16, alpha 16, targets model.layers.*.self_attn.[qv]_proj" in replica.kept
    # v_proj is 2 KV heads of 4 wide: rank 8 at most, with alpha / rank kept (16 / 16 = 8 / 8)
    assert (lora.rank, lora.alpha) == (8, 8.0)
    assert "LoRA rank 16 -> 8, alpha 16 -> 8 (the same alpha / rank)" in replica.shrunk


def test_auto_layout_is_resolved_for_the_world(tmp_path: Path) -> None:
    overrides = [("model.preset", "test"), ("parallel.layout", "auto"), ("data.seq_len", 64), ("train.global_batch", 8)]
    cfg = load_config(None, overrides)
    with pytest.raises(ShrinkError, match=r"^parallel.layout = 'auto' needs the target world size"):
        shrink(cfg, tmp_path)
    replica = shrink(cfg, tmp_path, world=4)
    target = parse_layout(replica.target_layout, 4)
    assert target.world_size == 4
    assert parse_layout(replica.config.parallel.layout, map_layout(target).world_size) == map_layout(target)


def one_line_refusal(overrides: list[tuple[str, object]], tmp_path: Path, **kwargs: object) -> str:
    with pytest.raises(ShrinkError) as info:
        run(overrides, tmp_path, **kwargs)
    assert isinstance(info.value, InputError) and "\n" not in str(info.value)
    return str(info.value)


def test_refusals_are_one_line_naming_the_constraint(tmp_path: Path) -> None:
    too_many = [("model.preset", "tiny-moe"), ("parallel.layout", "dp=2,cp=2,tp=2,ep=2")]
    assert "needs 16 CPU ranks, more than max_ranks=8" in one_line_refusal(too_many, tmp_path)
    world = [("model.preset", "test"), ("data.seq_len", 64), ("parallel.layout", "dp=3,tp=2")]
    assert "the world size is 8" in one_line_refusal(world, tmp_path, world=8)
    heads = [("model.preset", "test"), ("data.seq_len", 64), ("parallel.layout", "tp=8")]  # 4 heads do not split over 8
    assert "model.n_heads (4) is not divisible by tp=8" in one_line_refusal(heads, tmp_path)
    # The run's 3 micro-batches per replica fill its pp=3 interleaved schedule, but not pp=2's.
    interleaved = [
        ("model.preset", "test"),
        ("data.seq_len", 64),
        ("parallel.layout", "pp=3"),
        ("parallel.schedule", "interleaved"),
        ("model.n_layers", 6),
        ("train.global_batch", 3),
        ("train.micro_batch", 1),
    ]
    assert "micro-batches per replica (3) divisible by pp=2" in one_line_refusal(interleaved, tmp_path)


DIM_SIZES = st.sampled_from([1, 1, 2, 4, 8])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pp=DIM_SIZES,
    dp=DIM_SIZES,
    tp=DIM_SIZES,
    cp=st.sampled_from([1, 2, 4]),
    kv=st.sampled_from([1, 2, 4, 8]),
    ratio=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([8, 16, 64]),
    layers=st.integers(1, 24),
    micro=st.sampled_from([1, 2, 4, 8]),
    interleaved=st.booleans(),
    sp=st.booleans(),
    ulysses=st.booleans(),
)
def test_every_replica_passes_meshlms_own_layout_checks(
    tmp_path: Path,
    pp: int,
    dp: int,
    tp: int,
    cp: int,
    kv: int,
    ratio: int,
    head_dim: int,
    layers: int,
    micro: int,
    interleaved: bool,
    sp: bool,
    ulysses: bool,
) -> None:
    """Any run that meshlm accepts at its layout either shrinks to a replica that meshlm accepts at the
    mapped layout, keeping the GQA ratio, the KV-head regime over tp and the micro-batches per replica, or is
    refused in one line."""
    overrides = [
        ("model.preset", "test"),
        ("model.n_kv_heads", kv),
        ("model.n_heads", kv * ratio),
        ("model.dim", kv * ratio * head_dim),
        ("model.intermediate_size", 96 * tp),
        ("model.vocab_size", 1024),
        ("model.n_layers", layers),
        ("model.max_seq_len", 4096),
        ("data.seq_len", 1024),
        ("parallel.layout", f"pp={pp},dp={dp},cp={cp},tp={tp}"),
        ("parallel.schedule", "interleaved" if interleaved else "1f1b"),
        ("parallel.virtual_stages", 2 if interleaved else 1),
        ("parallel.sequence_parallel", sp),
        ("parallel.cp_attention", "ulysses" if ulysses else "ring"),
        ("train.global_batch", dp * micro * pp),
        ("train.micro_batch", 1),
    ]
    try:
        cfg = load_config(None, overrides)
        target_micro = check_config(cfg, pp * dp * cp * tp)[1]
    except InputError:
        assume(False)
    try:
        replica = shrink(cfg, tmp_path)
    except ShrinkError as e:
        assert "\n" not in str(e)
        assume(False)
    mapped = map_layout(Layout(pp=pp, dp=dp, tp=tp, cp=cp))
    assert parse_layout(replica.config.parallel.layout, mapped.world_size) == mapped
    assert check_config(replica.config, mapped.world_size)[1] == target_micro
    model, small = cfg.model.build(), replica.config.model.build()
    assert small.n_heads // small.n_kv_heads == ratio
    assert (kv % tp == 0) == (small.n_kv_heads % mapped.tp == 0)  # KV heads split or replicated, as in the run
    chunks = 2 if interleaved else 1
    if pp > 1:  # layers split evenly over the pipeline chunks, or not, as in the run
        assert (small.n_layers % (mapped.pp * chunks) == 0) == (layers % (pp * chunks) == 0)
    assert small.dim <= model.dim and small.n_layers <= max(model.n_layers, 2) and small.vocab_size <= 1024
    assert replica.config.data.seq_len <= 64


def rows_of_heads(heads: int, head_dim: int, kept: int) -> list[int]:
    """The rows of the first `heads` heads of width `head_dim`, each cut to its first kept/2 rotary pairs."""
    return [
        h * head_dim + i
        for h in range(heads)
        for i in [*range(kept // 2), *range(head_dim // 2, head_dim // 2 + kept // 2)]
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_hf_init_from_is_sliced_and_loads_at_the_replica(family: str, tmp_path: Path) -> None:
    """A GQA Llama and a Qwen2 with q/k/v biases and tied embeddings, at pp=2,tp=2: the replica's init_from is
    an HF directory that meshlm loads at the replica's model, holding the first heads (each cut keeping rotary
    pairs), rows, columns and layers of the checkpoint's own tensors."""
    transformers = pytest.importorskip("transformers")
    shape = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    }  # fmt: skip
    config = (
        transformers.LlamaConfig(**shape)
        if family == "llama"
        else transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_()  # no constant norms or zero biases: every element differs
    hf_model.save_pretrained(tmp_path / "hf")
    overrides = [
        ("model.init_from", str(tmp_path / "hf")),
        ("parallel.layout", "pp=2,tp=2"),
        ("train.micro_batch", 2),
        ("data.seq_len", 128),
    ]
    _, replica = run(overrides, tmp_path / "work")
    small = replica.config.model.build()
    assert (small.n_heads, small.n_kv_heads, small.head_dim, small.dim) == (4, 2, 4, 16)
    assert (small.n_layers, small.intermediate_size, small.vocab_size) == (2, 24, 258)
    assert small.tie_embeddings == (family == "qwen2-tied") and small.qkv_bias == (family == "qwen2-tied")
    model = load_hf_into_model(replica.config.model.init_from)
    assert model.cfg == small
    q, kv = rows_of_heads(4, 16, 4), rows_of_heads(2, 16, 4)
    big = hf_model.state_dict()
    for name, tensor in model.state_dict().items():
        if ".layers." in name:
            assert int(name.split(".")[2]) < 2
        rows, cols = list(range(tensor.shape[0])), list(range(tensor.shape[1])) if tensor.ndim == 2 else None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            rows = q
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            rows = kv
        elif name.endswith("o_proj.weight"):
            cols = q
        expected = big[name][rows] if cols is None else big[name][rows][:, cols]
        assert torch.equal(tensor, expected), name
    assert model.lm_head.weight is model.model.embed_tokens.weight or family == "llama"
    assert any(line.startswith(f"init_from {tmp_path / 'hf'} -> ") for line in replica.shrunk)


def test_hf_moe_experts_are_sliced_from_their_own_tensors(tmp_path: Path) -> None:
    """A Qwen2-MoE (8 experts stored one tensor each, a gated shared expert, a dense first layer) at dp=2,ep=2:
    the replica holds the first experts of each MoE layer, each expert cut to its first rows and columns."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0],
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_()
    hf_model.save_pretrained(tmp_path / "hf")
    overrides = [("model.init_from", str(tmp_path / "hf")), ("parallel.layout", "dp=2,ep=2"), ("data.seq_len", 128)]
    _, replica = run(overrides, tmp_path / "work")
    small = replica.config.model.build()
    assert (small.n_experts, small.top_k, small.first_k_dense, small.n_layers) == (4, 2, 1, 2)
    assert (small.dim, small.moe_intermediate_size, small.shared_expert_intermediate_size) == (8, 4, 6)
    sliced = load_hf_into_model(replica.config.model.init_from).state_dict()
    big = import_hf(tmp_path / "hf")[1]
    for name in ("model.layers.1.mlp.experts.gate_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(sliced[name], big[name][: small.n_experts, : sliced[name].shape[1], : sliced[name].shape[2]])
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
                 "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.up_proj.weight"):  # fmt: skip
        assert torch.equal(sliced[name], big[name][: sliced[name].shape[0], : sliced[name].shape[1]]), name


def test_meshlm_run_init_from_is_sliced_with_its_tokenizer(tmp_path: Path) -> None:
    """A meshlm run as init_from (one step of the `test` preset on a small corpus): the replica's copy holds
    the first heads, rows and columns of the run's trained weights and the run's own tokenizer, whose size
    bounds the shrunk vocabulary."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i:02d}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 3)
    overrides = {
        "model.preset": "test", "data.source": str(corpus), "data.cache_dir": str(tmp_path / "cache"),
        "data.seq_len": 64, "data.val_fraction": 0.1, "train.steps": 1, "train.global_batch": 2,
        "train.eval_every": 0, "train.device": "cpu", "checkpoint.async_save": False,
        "log.run_dir": str(tmp_path / "run"), "log.tensorboard": False, "log.progress": False,
    }  # fmt: skip
    fit(load_config(None, list(overrides.items())))
    trained, _ = load_checkpoint_model(tmp_path / "run")
    overrides |= {"model.init_from": str(tmp_path / "run"), "parallel.layout": "dp=2,tp=2"}
    del overrides["model.preset"]
    _, replica = run(list(overrides.items()), tmp_path / "work")
    copy = Path(replica.config.model.init_from)
    assert (copy / "tokenizer.json").read_bytes() == (tmp_path / "run" / "tokenizer.json").read_bytes()
    small = replica.config.model.build()
    assert (small.dim, small.n_heads, small.n_kv_heads, small.n_layers) == (16, 4, 2, 2)
    assert small.vocab_size < 512 and small.vocab_size % 2 == 0
    sliced = load_hf_into_model(copy).state_dict()
    big = trained.state_dict()
    q = rows_of_heads(4, 16, 4)
    assert torch.equal(
        sliced["model.layers.1.self_attn.q_proj.weight"], big["model.layers.1.self_attn.q_proj.weight"][q][:, :16]
    )
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(sliced[name], big[name][: sliced[name].shape[0], : sliced[name].shape[1]]), name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pp=DIM_SIZES,
    dp=DIM_SIZES,
    ep=DIM_SIZES,
    tp=DIM_SIZES,
    experts=st.sampled_from([2, 4, 8, 16, 64]),
    top_k=st.sampled_from([1, 2, 4]),
    first_k_dense=st.sampled_from([0, 1]),
    step=st.sampled_from([1, 2]),
    layers=st.integers(2, 12),
)
def test_every_moe_replica_passes_meshlms_own_layout_checks(
    tmp_path: Path, pp: int, dp: int, ep: int, tp: int, experts: int, top_k: int, first_k_dense: int, step: int,
    layers: int,
) -> None:  # fmt: skip
    """The same for mixture-of-experts runs under ep: the experts split over the mapped ep, routing still
    chooses top_k of more experts than it takes, and the dense and MoE layers keep their pattern."""
    overrides = [
        ("model.preset", "tiny-moe"),
        ("model.n_experts", experts),
        ("model.top_k", top_k),
        ("model.first_k_dense", first_k_dense),
        ("model.moe_layer_step", step),
        ("model.n_layers", layers),
        ("parallel.layout", f"pp={pp},dp={dp},ep={ep},tp={tp}"),
        ("train.global_batch", dp * ep * pp),
        ("train.micro_batch", 1),
    ]
    try:
        cfg = load_config(None, overrides)
        check_config(cfg, pp * dp * ep * tp)
    except InputError:
        assume(False)
    try:
        replica = shrink(cfg, tmp_path)
    except ShrinkError as e:
        assert "\n" not in str(e)
        assume(False)
    mapped = map_layout(Layout(pp=pp, dp=dp, tp=tp, ep=ep))
    check_config(replica.config, mapped.world_size)
    model, small = cfg.model.build(), replica.config.model.build()
    assert small.n_experts % mapped.ep == 0 and small.n_experts <= max(experts, 2 * mapped.ep)
    assert small.top_k == top_k and (small.top_k < small.n_experts) == (top_k < experts)
    assert (small.first_k_dense, small.moe_layer_step) == (first_k_dense, step)
    assert small.moe_layers and (small.moe_layers[0] == first_k_dense) == (model.moe_layers[0] == first_k_dense)


def test_hybrid_zero_shards_over_two_ranks(tmp_path: Path) -> None:
    overrides = [("model.preset", "test"), ("data.seq_len", 64), ("parallel.layout", "dp=8,cp=2")]
    overrides += [("parallel.zero", 2), ("parallel.zero_shard_size", 4)]
    _, replica = run(overrides, tmp_path)
    assert (replica.config.parallel.zero, replica.config.parallel.zero_shard_size) == (2, 2)
    assert "ZeRO shard groups of 4 -> 2 ranks" in replica.shrunk


@pytest.mark.parametrize(("blocks", "layers"), [(3, 4), (16, 2)])
def test_recompute_of_the_first_blocks_of_each_chunk_stays_partial_or_whole(
    blocks: int, layers: int, tmp_path: Path
) -> None:
    """3 of a chunk's 16 blocks recomputed: the replica's chunks get 2 blocks and recompute the first; all 16:
    its chunks get 1 block, recomputed."""
    overrides = [("model.preset", "llama3-8b"), ("parallel.layout", "pp=2,dp=2"), ("data.seq_len", 2048)]
    overrides += [("train.micro_batch", 1), ("train.recompute", "selective"), ("train.recompute_layers", blocks)]
    _, replica = run(overrides, tmp_path)
    assert replica.config.model.build().n_layers == layers
    assert (replica.config.train.recompute, replica.config.train.recompute_layers) == ("selective", 1)


def test_sft_keeps_its_data_section_with_room_for_prompts(tmp_path: Path) -> None:
    (tmp_path / "chats.jsonl").write_text('{"prompt": "2 + 2?", "response": "4"}\n')
    overrides = [("model.preset", "llama3-8b"), ("parallel.layout", "dp=2,tp=2"), ("data.seq_len", 4096)]
    overrides += [("data.format", "sft"), ("data.source", str(tmp_path / "chats.jsonl")), ("data.sft_packing", False)]
    cfg, replica = run(overrides, tmp_path / "work")
    assert replica.config.data == cfg.data.model_copy(update={"seq_len": 256})
