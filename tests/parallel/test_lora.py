"""LoRA and frozen weights under every strategy, against one process (tests/equivalence.py's criteria).

meshlm's Llama (test preset) and a Hugging Face LlamaForCausalLM (random, from a config) get rank-4 adapters
on the plan's attention and MLP projections (dropout 0: exact), then train 10 AdamW steps (per-step loss and
gradient norm within 1e-5 relative) and 4 SGD steps (final adapter weights within criterion 2's float32
bound) under dp=2 ZeRO-3, tp=2, pp=2 (meshlm's Llama: HF's forward cannot run a pipeline stage) and
dp=2×tp=2. The frozen base must come out bit-identical, and hold no gradient and no optimizer state. A
mutation that reduces the row-parallel adapter's partial output on its own and then again with the base's
(the partial sum applied twice) must fail the loss criterion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_shared
from equivalence import TEST_MODEL, assert_close_runs, criterion_failures, global_batch
from torch import nn

import meshlm
from meshlm.model import Transformer
from meshlm.model.lora import lora_delta
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.transforms.lora import LoRAError, LoRALinear, apply_lora, freeze

RANK, ALPHA = 4, 8.0
BATCH, SEQ = 8, 16
HF_VOCAB = 128


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def llama() -> nn.Module:
    return Transformer(TEST_MODEL)


def llama_on_meta() -> nn.Module:
    """What `meshlm train` builds: each rank materialises only its shard (ZeRO-3: of the frozen base too),
    with the weights of `llama()` in one process, element for element."""
    with torch.device("meta"):
        return Transformer(TEST_MODEL, init_seed=0)


FAMILIES = {
    "llama": (llama, TEST_MODEL.vocab_size),
    "llama-transform": (llama, TEST_MODEL.vocab_size),  # adapted by meshlm.parallelize(lora=...), not by hand
    "llama-meta": (llama_on_meta, TEST_MODEL.vocab_size),
    "hf": (hf_llama, HF_VOCAB),
}


def lora_run(
    layout: str,
    family: str = "llama",
    optimizer: str = "adamw",
    start: int = 0,
    stop: int | None = None,
    checkpoints: str | None = None,
    **parallel: object,
) -> dict:
    """Train `family` with LoRA under `layout` in a plain loop: {'losses', 'grad_norms', 'state' (full fp32
    weights), 'base_unchanged', 'frozen_state_free', 'optimizer', 'updates', 'moved'} (equivalence.py's run),
    over steps start..stop-1. With `checkpoints`, the newest checkpoint there is loaded first (if any) and
    step `stop` saved at the end (meshlm.Checkpoints)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    build, vocab = FAMILIES[family]
    mesh = build_mesh(parse_layout(layout, world), "cpu")
    torch.manual_seed(0)
    model = build()
    by_transform = family == "llama-transform"
    if not by_transform:
        apply_lora(model, RANK, ALPHA, seed=1)
    whole = model
    if family in ("llama-meta", "llama-transform"):  # the weights it must start from: the model built whole
        torch.manual_seed(0)
        whole = llama()
        apply_lora(whole, RANK, ALPHA, seed=1)
    base = {n for n, p in whole.named_parameters() if not p.requires_grad}
    initial = {n: t.detach().clone() for n, t in whole.state_dict().items()}
    micro = 2 if "pp" in layout else 1
    lora = {"rank": RANK, "alpha": ALPHA} if by_transform else None
    pm = meshlm.parallelize(model, mesh, {**(parallel or {}), "micro_batches": micro}, lora=lora, lora_seed=1)
    steps = 4 if optimizer == "sgd" else 10
    if optimizer == "sgd":
        opt = torch.optim.SGD(pm.parameters(), lr=0.2)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    saves = meshlm.Checkpoints(checkpoints, async_save=False) if checkpoints else None
    if saves is not None and (saved := saves.load_latest(pm, opt)) is not None:
        assert saved["step"] == start, (saved["step"], start)
    stop = steps if stop is None else stop
    losses, norms = [], []
    for step in range(start, stop):
        x, y = global_batch(step, BATCH, SEQ, vocab)
        loss = pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
        frozen_grads = [p for _, p in pm.named_parameters() if not p.requires_grad and p.grad is not None]
        norms.append(pm.clip_grad_norm_(1.0).item())
        pm.step(opt)
        losses.append(loss.item())
    if saves is not None:
        saves.save(stop, pm, opt)
        saves.wait()
    state = pm.full_state_dict()
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    frozen_held = [p for _, p in pm.named_parameters() if not p.requires_grad]
    return {
        "losses": losses,
        "grad_norms": norms,
        "state": {n: t for n, t in state.items() if n not in base},
        "base_unchanged": all(torch.equal(state[n], initial[n]) for n in base),
        "frozen_state_free": not frozen_grads and not any(id(p) in stepped for p in frozen_held),
        "optimizer": optimizer,
        "updates": steps,
        "moved": {n: (t - initial[n]).abs().max().item() for n, t in state.items() if n not in base},
    }


# ---- the mutation: the row-parallel adapter's partial sum reduced twice ----------------------------------
@contextlib.contextmanager
def row_adapter_reduced_twice() -> Iterator[list]:
    """The adapter's partial output all-reduced by itself, then again inside the base's all-reduce: tp× the
    update on every row-parallel projection (o_proj, down_proj)."""
    from meshlm.parallel.tp import sharding as tensor_parallel
    from meshlm.parallel.tp.ops import reduce_from_tp

    fired: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.adapted:
            fired.append(1)
            y = y + reduce_from_tp(lora_delta(self, x), self.tp.group)
        y = reduce_from_tp(y, self.tp.group)
        return y if self.bias is None else y + self.bias

    original = tensor_parallel.RowParallelLinear.forward
    tensor_parallel.RowParallelLinear.forward = forward
    try:
        yield fired
    finally:
        tensor_parallel.RowParallelLinear.forward = original


def _mutated_tp_run() -> dict:
    with row_adapter_reduced_twice() as fired:
        run = lora_run("tp=2")
    return {**run, "fired": len(fired)}


@contextlib.contextmanager
def adapt_dropped() -> Iterator[None]:
    """The Adapt transform left out of the strategy list: `meshlm.parallelize(lora=...)` trains the whole model."""
    from meshlm.parallel import strategies
    from meshlm.parallel.transforms.strategy import Adapt

    original = strategies.STRATEGIES
    strategies.STRATEGIES = tuple(s for s in original if not isinstance(s, Adapt))
    try:
        yield
    finally:
        strategies.STRATEGIES = original


def _adapt_dropped_run() -> dict:
    with adapt_dropped():
        return lora_run("tp=2", "llama-transform", "sgd")


# ---- world 2 -------------------------------------------------------------------------------------------
WORLD2_FAST = [
    ("dp=2", "llama", "adamw", {"zero": 3}),
    ("tp=2", "llama", "adamw", {}),
    # meshlm.parallelize(lora=...): the Adapt transform, checked against LoRA applied by hand in one process
    ("tp=2", "llama-transform", "adamw", {}),
    ("tp=2", "llama-transform", "sgd", {}),
]
WORLD2_META = [("dp=2", "llama-meta", "adamw", {"zero": 3}), ("tp=2", "llama-meta", "adamw", {"zero": 3})]
WORLD2 = [
    ("dp=2", "llama", "sgd", {"zero": 3}),
    ("tp=2", "llama", "sgd", {}),
    ("tp=2", "llama", "adamw", {"sequence_parallel": True}),
    ("pp=2", "llama", "adamw", {}),
    ("pp=2", "llama", "sgd", {}),
    ("dp=2", "llama", "adamw", {"zero": 1}),
    ("cp=2", "llama", "adamw", {}),
]
WORLD2_HF = [
    ("dp=2", "hf", "adamw", {"zero": 3}),
    ("dp=2", "hf", "sgd", {"zero": 3}),
    ("tp=2", "hf", "adamw", {}),
    ("tp=2", "hf", "sgd", {}),
]


def _world2(cases: list[tuple]) -> list[dict]:
    return [lora_run(layout, family, optimizer, **par) for layout, family, optimizer, par in cases]


def _reference_family(family: str) -> str:
    """The one-process run a family is checked against: the transform's is LoRA applied by hand."""
    return "llama" if family == "llama-transform" else family


def _check(cases: list[tuple], results: list[list[dict]]) -> None:
    refs = {(family, opt): lora_run("", _reference_family(family), opt) for _, family, opt, _ in cases}
    for ref in refs.values():
        assert ref["base_unchanged"] and ref["frozen_state_free"]
    for rank, runs in enumerate(results):
        for (layout, family, opt, par), got in zip(cases, runs, strict=True):
            where = f"rank {rank} {family} {layout} {par} {opt}"
            assert got["base_unchanged"], f"{where}: a frozen base weight changed"
            assert got["frozen_state_free"], f"{where}: a frozen weight got a gradient or optimizer state"
            try:
                assert_close_runs(refs[family, opt], got)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from None
    # The adapters learn: the comparison is not between runs that do nothing.
    ref = refs[cases[0][1], "adamw"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.01, ref["losses"]


def test_lora_llama_under_dp_zero3_and_tp_matches_one_process() -> None:
    _check(WORLD2_FAST, run_shared(_world2, 2, WORLD2_FAST))


@pytest.mark.slow  # two two-rank runs and their reference: ~15 s on a 2-vCPU VM
def test_lora_on_a_meta_built_llama_under_zero3_matches_one_process() -> None:
    _check(WORLD2_META, run_shared(_world2, 2, WORLD2_META))
    assert lora_run("", "llama-meta")["losses"] == lora_run("", "llama")["losses"]


@pytest.mark.slow  # seven more two-rank runs (SGD twins, sequence parallel, pp, ZeRO-1, cp): ~45 s on a 2-vCPU VM
def test_lora_llama_under_every_two_rank_layout_matches_one_process() -> None:
    _check(WORLD2, run_shared(_world2, 2, WORLD2))


def test_row_parallel_adapter_reduced_twice_is_caught() -> None:
    ref = lora_run("", "llama", "adamw")
    mutated = run_shared(_mutated_tp_run, 2)
    assert sum(r["fired"] for r in mutated) > 0, "the mutation never fired (code moved?)"
    assert "losses" in criterion_failures(ref, mutated[0]), "the loss criterion passed a doubled adapter sum"


def test_parallelize_without_the_adapt_transform_is_caught() -> None:
    """The mutation check of the transform's cases above: with Adapt dropped from the strategy list,
    `meshlm.parallelize(lora=...)` at tp=2 trains the base too, and the loss and weight criteria fail."""
    ref = lora_run("", "llama", "sgd")
    mutated = run_shared(_adapt_dropped_run, 2)[0]
    assert not mutated["base_unchanged"], "the base stayed frozen without the transform (did it run elsewhere?)"
    assert set(criterion_failures(ref, mutated)) == {"losses", "weights"}


@pytest.mark.slow  # four two-rank runs of a transformers model: ~30 s on a 2-vCPU VM
def test_lora_hf_llama_under_dp_zero3_and_tp_matches_one_process() -> None:
    pytest.importorskip("transformers")
    _check(WORLD2_HF, run_shared(_world2, 2, WORLD2_HF))


WORLD4 = [("dp=2,tp=2", "llama", "adamw", {"zero": 3}), ("dp=2,tp=2", "hf", "adamw", {"zero": 1})]


@pytest.mark.slow  # four ranks, two families, 10 steps each: ~15 s on a 2-vCPU VM
def test_lora_under_dp_tp_matches_one_process() -> None:
    pytest.importorskip("transformers")
    _check(WORLD4, run_shared(_world2, 4, WORLD4))


# ---- checkpoints: only the adapters, resharded on resume --------------------------------------------------
def _first_half(run_dir: str) -> dict:
    return lora_run("dp=2", "llama", "adamw", stop=5, checkpoints=run_dir, zero=3)


def test_lora_checkpoint_holds_only_adapters_and_resumes_under_another_layout(tmp_path) -> None:
    """Steps 0-4 under dp=2 ZeRO-3, saved; steps 5-9 resumed in one process (the base rebuilt from the seed):
    the second half's losses are the one-process run's."""
    from meshlm.checkpoint import latest_valid_checkpoint, load_model_state

    ref = lora_run("", "llama", "adamw")
    run_shared(_first_half, 2, str(tmp_path))
    saved = load_model_state(latest_valid_checkpoint(tmp_path))
    assert saved and all(".lora_" in name for name in saved), sorted(saved)[:3]
    resumed = lora_run("", "llama", "adamw", start=5, checkpoints=str(tmp_path))
    assert resumed["base_unchanged"]
    assert_close_runs({"losses": ref["losses"][5:], "grad_norms": ref["grad_norms"][5:]}, resumed)


# ---- the library call's bad input: one line each ----------------------------------------------------------
def test_bad_lora_requests_are_one_line() -> None:
    with pytest.raises(LoRAError, match=r"lora.targets: 'model.layers.\*.nope' matches no nn.Linear") as e:
        apply_lora(llama(), 4, targets=["model.layers.*.nope"])
    assert "\n" not in str(e.value)
    for rank in (0, -2):
        with pytest.raises(LoRAError, match=r"lora\.rank must be a positive integer"):
            apply_lora(llama(), rank)
    with pytest.raises(LoRAError, match=r"train\.freeze: pattern 'emb' matches no parameter"):
        freeze(llama(), ["emb"])


def test_freeze_and_apply_lora_mark_what_trains() -> None:
    model = llama()
    assert freeze(model, ["model.embed_tokens.*"]) == ["model.embed_tokens.weight"]
    assert not model.model.embed_tokens.weight.requires_grad and model.lm_head.weight.requires_grad
    names = apply_lora(model, 2, targets=["model.layers.0.self_attn.[qv]_proj"])
    assert names == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == [f"model.layers.0.self_attn.{m}_proj.lora_{f}" for m in "qv" for f in "AB"]
    assert isinstance(model.model.layers["0"].self_attn.q_proj, LoRALinear)


# ---- memory: what a LoRA rank holds under ZeRO-3, as the planner predicts --------------------------------
def _held_bytes(lora: bool) -> dict[str, int]:
    mesh = build_mesh(parse_layout("dp=2", dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    model = llama()
    if lora:
        apply_lora(model, RANK, ALPHA)
    pm = meshlm.parallelize(model, mesh, {"zero": 3})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    x, y = global_batch(0, 4, SEQ, TEST_MODEL.vocab_size)
    pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
    pm.step(opt)
    return pm.dp.memory_report(opt)


def _both_held() -> list[dict[str, int]]:
    return [_held_bytes(False), _held_bytes(True)]


def test_zero3_lora_rank_holds_a_base_shard_and_adapter_state_as_the_planner_predicts() -> None:
    """Measured model state per rank (parameters with masters, gradients, AdamW moments) within 10% of the
    planner's (it ignores only the flat buffers' padding to a multiple of dp: a few elements)."""
    from meshlm.plan.hardware import hardware
    from meshlm.plan.memory import Candidate, Workload, memory

    full, lora = run_shared(_both_held, 2)[0]
    for held, rank in ((full, 0), (lora, RANK)):
        w = Workload(TEST_MODEL, SEQ, 4, 1.0, "fp32", "test", rank)
        mem = memory(w, Candidate(mesh=parse_layout("dp=2", 2), options=ParallelOptions(zero=3)), hardware("cpu"))
        for part, predicted in (("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer)):
            assert abs(predicted - held[part]) <= 0.1 * held[part], (rank, part, predicted, held[part])
    # The base is sharded (half of it per rank), and only the adapters have gradients and moments.
    base_bytes = 4 * sum(p.numel() for p in llama().parameters())
    assert abs(lora["params"] - base_bytes / 2) < 0.1 * base_bytes / 2
    assert lora["optimizer"] < full["optimizer"] / 10 and lora["grads"] < full["grads"] / 10


# ---- a bf16 frozen base under bf16 autocast --------------------------------------------------------------
def _autocast_losses(bf16_base: bool, zero: int) -> tuple[list[float], object]:
    from meshlm.parallel.transforms.lora import cast_frozen_linears

    mesh = build_mesh(parse_layout("", 1), "cpu")
    torch.manual_seed(0)
    model = llama()
    apply_lora(model, RANK, ALPHA, seed=1)
    if bf16_base:
        assert cast_frozen_linears(model, torch.bfloat16) == 7 * TEST_MODEL.n_layers + 1  # and the head
    pm = meshlm.parallelize(model, mesh, {"zero": zero, "autocast_dtype": "bf16"})
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses = []
    for step in range(3):
        x, y = global_batch(step, 4, SEQ, TEST_MODEL.vocab_size)
        losses.append(pm.forward_backward(x, y).item())
        pm.step(opt)
    return losses, pm


def test_frozen_linears_in_bf16_change_nothing_under_bf16_autocast() -> None:
    """Autocast casts every Linear weight to bf16 at each use, so a frozen base stored in bf16 trains
    bit-identically, and ZeRO-3 keeps its shards in bf16 with no fp32 master."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    want, _ = _autocast_losses(False, 0)
    got, _ = _autocast_losses(True, 0)
    assert got == want
    got, pm = _autocast_losses(True, 3)
    assert got == want
    dtypes = {buf.master.dtype for buf in pm.dp.frozen_buffers}
    assert dtypes == {torch.bfloat16, torch.float32}  # linears in bf16; embeddings and norms as built


def test_bad_lora_config_stops_meshlm_train_in_one_line_before_any_work(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshlm.cli import main

    base = ["train", "--model.preset", "test", "--data.seq_len", "32", "--lora.rank", "4"]
    cases = {
        "lora.targets: 'model.layers.*.nope' matches no nn.Linear": ["--lora.targets", '["model.layers.*.nope"]'],
        "train.freeze: pattern 'emb' matches no parameter": ["--train.freeze", '["emb"]'],
        "is not a PEFT adapter directory": ["--lora.init_from", str(tmp_path / "none")],
        "lora.rank: Input should be greater than or equal to 0": ["--lora.rank", "-1"],
    }
    for expected, extra in cases.items():
        capsys.readouterr()
        assert main([*base, *extra, "--log.run_dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "run").exists()


# ---- the planner's LoRA terms ------------------------------------------------------------------------------
def test_planner_fits_a_70b_lora_job_where_a_full_fine_tune_does_not() -> None:
    from meshlm.model import preset
    from meshlm.plan import Candidate, PlannerError, Workload, best, hardware, memory, step_time
    from meshlm.plan.step_time import lora_flops_per_token

    model, h100 = preset("llama3-70b"), hardware("H100-SXM")
    with pytest.raises(PlannerError):
        best(Workload(model, 4096, 64, 1e9), 8, h100)
    lora = Workload(model, 4096, 64, 1e9, lora_rank=16)
    plan = best(lora, 8, h100)
    # Under the pick's mesh at zero=0 the full run keeps fp32 weights under bf16 autocast (4 B/param, what the
    # runtime holds), the LoRA run its frozen base in bf16 (2 B/param) plus the adapters; no gradients or Adam
    # state for the base.
    at_zero0 = plan.strategy.with_options(zero=0)
    full_mem = memory(Workload(model, 4096, 64, 1e9), at_zero0, h100)
    lora_mem = memory(lora, at_zero0, h100)
    assert 0.5 * full_mem.params < lora_mem.params < 0.52 * full_mem.params  # rank-16 adapters: ~1% more
    assert lora_mem.grads < full_mem.grads / 100 and lora_mem.optimizer < full_mem.optimizer / 100
    # No weight-gradient GEMMs for the base: a LoRA step does about two thirds of the full step's FLOPs.
    ratio = lora_flops_per_token(model, 4096, 16) / lora_flops_per_token(model, 4096)
    assert 0.6 < ratio < 0.75, ratio
    s = Candidate(mesh=plan.strategy.mesh, options=ParallelOptions(zero=plan.strategy.zero))
    assert step_time(lora, s, h100).compute < step_time(Workload(model, 4096, 64, 1e9), s, h100).compute
