"""Meta-device construction and shard-only materialisation (meshlm.model.init, meshlm.parallel.materialize).

* the element init: any row / column slice and flat range, in any dtype, equals that part of the whole
  tensor; meshlm's Transformer depends on its seed only, not on the RNG stream;
* meshlm's Llama built on `meta` starts bit-identical to the one-process `Transformer(cfg)` under every
  layout (tp with replicated KV heads, SP, pp, ZeRO 0-3, bf16 working weights, tied embeddings), and trains
  exactly as the full-then-shard path does;
* a model without `init_rule` (the GPT-2-style example) materialises module by module, equal across layouts
  and whatever each rank's own seed; a meta module with no way to initialise is refused in one line;
* acceptance: under a per-rank memory budget (RLIMIT_DATA) smaller than the model's fp32 size, the meta build
  sets up (peak ≤ 1.25 × its shard + slack) and trains under tp=2 × dp=2 ZeRO-3, while the full build, and
  the meta build without sharding, fail to allocate.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, run_shared
from equivalence import TEST_MODEL, global_batch
from torch import nn

import meshlm
from meshlm.model import ModelConfig, Transformer
from meshlm.model import init as element_init
from meshlm.model.init import Normal, fill_
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.materialize import MetaInit
from meshlm.parallel.mesh import Mesh, build_mesh, parse_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt2 import GPT2, GPT2_PLAN

WORLD = 4


# ---- the element init ---------------------------------------------------------------------------------
def test_any_slice_and_range_equals_that_part_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(element_init, "BLOCK_ELEMENTS", 64)  # many blocks, rows of several per block
    rule, seed, name = Normal(0.5), 7, "w"
    for shape in ((40, 9), (30, 100), (300,)):
        whole = fill_(torch.empty(shape).view(-1), rule, seed, name, shape).view(shape)
        assert whole.std().item() == pytest.approx(0.5, rel=0.2)
        assert not torch.equal(whole, fill_(torch.empty(shape).view(-1), rule, seed + 1, name, shape).view(shape))
        slices = [((0, 10), whole.narrow(0, 10, 13))]
        if len(shape) == 2:
            slices.append(((1, 3), whole.narrow(1, 3, shape[1] // 2)))
        for tp_slice, part in slices:
            flat = part.reshape(-1)
            got = fill_(torch.empty(flat.numel()), rule, seed, name, shape, part.shape, tp_slice)
            assert torch.equal(got, flat)
            n = flat.numel()
            for lo, hi in ((0, 1), (n // 3, n - 2), (n - 9, n)):  # ZeRO flat ranges
                got = fill_(torch.empty(hi - lo), rule, seed, name, shape, part.shape, tp_slice, start=lo)
                assert torch.equal(got, flat[lo:hi])
            bf16 = fill_(torch.empty(flat.numel(), dtype=torch.bfloat16), rule, seed, name, shape, part.shape, tp_slice)
            assert torch.equal(bf16, flat.to(torch.bfloat16))
    with pytest.raises(ValueError, match="outside the parameter"):
        fill_(torch.empty(4), rule, seed, name, (4, 4), (2, 2), (0, 3))


def test_transformer_weights_depend_on_the_seed_not_the_rng_stream() -> None:
    torch.manual_seed(5)
    a = Transformer(TEST_MODEL).state_dict()
    torch.manual_seed(5)
    torch.randn(1000)  # consumes the stream: the weights do not move
    b = Transformer(TEST_MODEL).state_dict()
    c = Transformer(TEST_MODEL, init_seed=5).state_dict()
    d = Transformer(TEST_MODEL, init_seed=6).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name
    assert not torch.equal(a["lm_head.weight"], d["lm_head.weight"])
    with torch.device("meta"):
        meta = Transformer(TEST_MODEL, init_seed=5)
    assert meta.lm_head.weight.is_meta and meta.init_seed == 5
    assert torch.equal(meta.rope_cos, Transformer(TEST_MODEL).rope_cos)  # constants stay real


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_meta_module_without_an_initialiser_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(
        ValueError,
        match=r"module 1 \(_Scale\) has meta parameters and nothing initialises them; give the model an init_weights",
    ):
        MetaInit(model, torch.device("cpu"))


# ---- every layout starts where one process does -------------------------------------------------------------
LLAMA_CASES = [
    ("dp=2,tp=2", {"zero": 3}, {}),
    ("dp=2,tp=2", {"zero": 3, "zero_param_dtype": "bf16"}, {}),
    ("dp=2,tp=2", {"zero": 2, "sequence_parallel": True}, {"tie_embeddings": True}),
    ("pp=2,tp=2", {"zero": 0}, {}),
    ("pp=2,dp=2", {"zero": 1}, {}),
    ("tp=4", {"sequence_parallel": True}, {}),  # 2 KV heads over 4 ranks: replicated
    ("dp=4", {"zero": 3, "zero_shard_size": 2}, {}),
]


def _parallel_model(layout: str, par: dict, cfg: ModelConfig, meta: bool) -> ParallelModel:
    mesh = build_mesh(parse_layout(layout, dist.get_world_size()), "cpu")
    torch.manual_seed(11)
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
    n_micro = 2 if "pp" in layout else 1
    return parallelize(model, mesh, {**par, "micro_batches": n_micro})


def _one_step(pm: ParallelModel) -> float:
    opt = torch.optim.AdamW(pm.optimizer_param_groups(0.1), lr=1e-2)
    x, y = global_batch(0, 8, 32, TEST_MODEL.vocab_size)
    loss = pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
    pm.clip_grad_norm_(1.0)
    pm.step(opt)
    return loss.item()


def _llama_layouts() -> list[dict]:
    out = []
    for layout, par, changes in LLAMA_CASES:
        cfg = TEST_MODEL.replace(**changes)
        meta, full = _parallel_model(layout, par, cfg, True), _parallel_model(layout, par, cfg, False)
        meta_params = [p for _, p in meta.named_parameters()]
        start = meta.full_state_dict()
        steps = [_one_step(meta), _one_step(full)]
        out.append(
            {
                "start": start,
                "trained": [meta.full_state_dict(), full.full_state_dict()],
                "losses": steps,
                "meta_left": any(p.is_meta for p in meta_params),
            }
        )
    return out


@pytest.mark.slow  # every layout's meta start on four ranks: ~9 s
def test_meta_llama_starts_bit_identical_to_one_process_under_every_layout() -> None:
    results = run_shared(_llama_layouts, WORLD)
    for (layout, par, changes), got in zip(LLAMA_CASES, results[0], strict=True):
        torch.manual_seed(11)
        ref = Transformer(TEST_MODEL.replace(**changes)).state_dict()
        where = f"{layout} {par} {changes}"
        assert not got["meta_left"], where
        assert got["start"].keys() == ref.keys(), where
        for name, tensor in ref.items():
            want = tensor.to(torch.bfloat16).float() if par.get("zero_param_dtype") == "bf16" else tensor
            assert torch.equal(got["start"][name], want), f"{where}: {name}"
        meta_state, full_state = got["trained"]
        assert got["losses"][0] == got["losses"][1], where
        for name in ref:
            assert torch.equal(meta_state[name], full_state[name]), f"{where}: {name} after a step"


# ---- a model without an element init: module by module --------------------------------------------------------
GPT2_LAYOUTS = [("dp=4", {"zero": 0}, 1), ("dp=2,tp=2", {"zero": 3}, 1), ("pp=2,tp=2", {}, 2)]  # + micro-batches


def _gpt2_layouts() -> list[dict[str, torch.Tensor]]:
    states = []
    for layout, options, micro_batches in GPT2_LAYOUTS:
        torch.manual_seed(dist.get_rank())  # the ranks disagree: rank 0's seed is used by all
        # Without its init_weights(), in __init__ (meta counts its writes: refused) or after: each module's
        # reset_parameters().
        with torch.device("meta"), mock.patch.object(GPT2, "init_weights", lambda self: None):
            model = GPT2(vocab=128, dim=32, n_layers=4, n_heads=4, max_len=16)
        model.init_weights = None
        mesh = build_mesh(parse_layout(layout, dist.get_world_size()), "cpu")
        pm = meshlm.parallelize(model, mesh, {**options, "micro_batches": micro_batches}, plan=GPT2_PLAN)
        states.append(pm.full_state_dict())
    return states


def test_meta_model_without_init_rule_agrees_across_layouts_and_ranks() -> None:
    results = run_shared(_gpt2_layouts, WORLD)
    first = results[0][0]
    assert first["wte.weight"].std().item() == pytest.approx(1.0, rel=0.2)  # nn.Embedding's own init
    assert torch.equal(first["ln_f.weight"], torch.ones(32))
    for rank, states in enumerate(results):
        for (layout, _, _), state in zip(GPT2_LAYOUTS, states, strict=True):
            assert state.keys() == first.keys()
            for name in first:
                assert torch.equal(state[name], first[name]), f"rank {rank} {layout}: {name}"


# ---- acceptance: a model larger than the per-rank budget ------------------------------------------------------
BIG = ModelConfig(
    vocab_size=4096, dim=512, n_layers=36, n_heads=8, n_kv_heads=4, intermediate_size=1536, max_seq_len=64
)  # 117M parameters: 448 MiB in fp32; a tp=2 × dp=2 ZeRO-3 rank holds 112 MiB of weights + 112 MiB of grads
MIB = 2**20
# Private writable memory a rank may add (RLIMIT_DATA): less than the fp32 parameters alone, and ~90 MiB more
# than sharded training peaked at (~340 MiB: the shard, gathered units, gradients in flight, activations,
# gloo's and the allocator's own), which grows with load (40 MiB of headroom once hit ENOMEM on a 6 MB gather).
BUDGET = 432 * MIB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# glibc's mallopt parameters (malloc.h). Set in the rank itself: forked ranks never read MALLOC_* variables.
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8


def _meter_live_memory() -> None:
    """Make RLIMIT_DATA meter live memory, not glibc's reuse pattern: every thread shares the one arena that
    exists (a thread that meets a locked arena would otherwise reserve a new 64 MiB one, counted in VmData,
    which is how a loaded machine ran out), and blocks of 1 MiB or more are mmap'd and return to the OS on free."""
    libc = ctypes.CDLL(None)
    if not (hasattr(libc, "mallopt") and libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_THRESHOLD, MIB)):
        raise RuntimeError("glibc mallopt unavailable")


def _budgeted_run(mesh: Mesh, zero: int, meta: bool) -> dict:
    """Set up (and, if that fits, train 2 SGD steps) under BUDGET; report the outcome and peak memory."""
    _meter_live_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    resource.setrlimit(resource.RLIMIT_DATA, (_status("VmData") + BUDGET, hard))
    try:
        torch.manual_seed(0)
        try:
            if meta:
                with torch.device("meta"):
                    model = Transformer(BIG)
            else:
                model = Transformer(BIG)
            pm = meshlm.parallelize(model, mesh, {"zero": zero})
        except RuntimeError as e:
            assert "can't allocate memory" in str(e), e
            return {"setup": False}
        peak = _status("VmHWM") - base
        shard = sum(buf.master.nbytes + buf.grad_shard.nbytes for buf in pm.dp.buffers)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x, y = global_batch(step, 2, 8, BIG.vocab_size)
            losses.append(pm.forward_backward(pm.local_batch(x), pm.local_batch(y)).item())
            pm.step(opt)
        return {"setup": True, "peak": peak, "shard": shard, "losses": losses}
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        dist.barrier()


def _budget_cases() -> list[dict]:
    sharded_mesh = build_mesh(parse_layout("dp=2,tp=2", WORLD), "cpu")
    replicated_mesh = build_mesh(parse_layout("dp=4", WORLD), "cpu")
    return [
        _budgeted_run(sharded_mesh, 3, meta=True),
        _budgeted_run(sharded_mesh, 3, meta=False),  # full-then-shard
        _budgeted_run(replicated_mesh, 0, meta=True),  # meta, but every rank keeps the whole model
    ]


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="needs glibc's mallopt to meter memory")
@pytest.mark.slow  # a 117M-parameter model on four ranks: ~25 s
def test_model_larger_than_the_rank_budget_trains_only_when_sharded() -> None:
    assert 4 * sum(p.numel() for p in Transformer(BIG).parameters()) > BUDGET
    # Fresh ranks (run_distributed): the limit and the malloc settings die with them.
    for rank, (sharded, full, unsharded) in enumerate(run_distributed(_budget_cases, WORLD, timeout=240)):
        assert sharded["setup"], rank
        assert all(torch.isfinite(torch.tensor(sharded["losses"]))), sharded
        assert sharded["peak"] <= 1.25 * sharded["shard"] + 16 * MIB, (rank, sharded)
        assert not full["setup"] and not unsharded["setup"], rank
