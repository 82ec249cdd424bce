"""Context parallel (ring and Ulysses attention on a `cp` mesh dimension) against the single-process run.

The attention cores are checked in float64 against meshlm's own causal attention (forward and all three
input gradients); whole training runs by tests/equivalence.py's criteria at cp = 2 and 4, with dp, ZeRO
and tp, and in a 4D world of 8 (pp2 × cp2 × tp2). Each mutation — a dropped ring hop (forward or the
backward hop that brings a K/V gradient home), the chunks in plain order on the data side or on the
rotary side only, the cp gradient reduction left out — must fail the loss criterion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, run_shared
from equivalence import (
    TEST_MODEL,
    _patched,
    assert_close_runs,
    criterion_failures,
    reference,
    train_layout,
    trainer_runs,
)

from meshlm.config import load_config, parse_overrides
from meshlm.data import prepare_data
from meshlm.errors import InputError
from meshlm.model import Transformer, preset
from meshlm.model.config import ModelConfig
from meshlm.model.llama import causal_attention, rotary_tables
from meshlm.observe.memory import ActivationMeter
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.cp import attention as cpm
from meshlm.parallel.dp import data_parallel
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import Layout, LayoutError, build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import ParallelPlan, PlanError
from meshlm.parallel.strategies import check_layout
from meshlm.plan.hardware import hardware
from meshlm.plan.memory import DEFAULTS, Candidate, Workload, layer_activation_bytes, logits_bytes
from meshlm.plan.step_time import cp_layer_time, ring_core_time, step_time
from meshlm.testing import global_batch
from meshlm.train.startup import check_config
from meshlm.train.trainer import train

MHA_MODEL = TEST_MODEL.replace(n_kv_heads=4)  # Ulysses at cp=4 needs key/value heads divisible by 4
MISTRAL = TEST_MODEL.replace(sliding_window=16, hf_model_type="mistral")
MUTATION_STEPS = 3  # every mutation changes the step-0 or step-1 loss by far more than LOSS_RTOL


# ---- no process group -----------------------------------------------------------------------------------
def test_chunk_positions_pair_chunk_i_with_its_mirror() -> None:
    for cp in (1, 2, 4):
        held = [cpm.chunk_positions(16, cp, r) for r in range(cp)]
        c = 16 // (2 * cp)
        for r, pos in enumerate(held):
            assert pos.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        assert sorted(torch.cat(held).tolist()) == list(range(16))
    batch = torch.arange(16).repeat(2, 1)
    assert cpm.shard_sequence(batch, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]] * 2
    with pytest.raises(ValueError, match="2·cp = 4"):
        cpm.chunk_positions(18, 2, 0)


def test_ring_computes_only_the_visible_part_of_each_block() -> None:
    cp, c = 2, 4
    pos = [cpm.chunk_positions(4 * c, cp, r) for r in range(cp)]
    assert cpm._block_plan(pos[0], pos[0]) == (slice(0, 2 * c), slice(0, 2 * c), True)  # own: causal, masked
    assert cpm._block_plan(pos[0], pos[1]) == (slice(c, 2 * c), slice(0, 2 * c), False)  # from a later rank
    assert cpm._block_plan(pos[1], pos[0]) == (slice(0, 2 * c), slice(0, c), False)  # from an earlier rank
    assert cpm._block_plan(torch.arange(4), torch.arange(4, 8)) is None  # all in the future
    for rank in range(4):  # load balance: every rank computes the same number of scores
        p = [cpm.chunk_positions(64, 4, r) for r in range(4)]
        plans = [cpm._block_plan(p[rank], p[src]) for src in range(4)]
        assert sum((b[0].stop - b[0].start) * (b[1].stop - b[1].start) for b in plans) == 16 * 16 + 3 * 8 * 16


def test_layout_with_cp() -> None:
    assert parse_layout("pp=2,cp=2,tp=2", 8) == Layout(pp=2, dp=1, tp=2, cp=2)
    assert parse_layout("cp=2", 8) == Layout(dp=4, cp=2)
    assert str(parse_layout("pp=2,cp=2,tp=2", 8)) == "pp=2,dp=1,cp=2,tp=2"
    assert str(parse_layout("dp=2", 2)) == "pp=1,dp=2,tp=1"  # layouts without cp read as before
    with pytest.raises(LayoutError, match="pp×cp×tp = 6 does not divide the world size 8"):
        parse_layout("cp=3,tp=2", 8)
    with pytest.raises(LayoutError, match="pp×dp×cp×tp = 4 but the world size is 8"):
        parse_layout("dp=2,cp=2", 8)


@pytest.mark.parametrize(
    ("layout", "cfg", "seq_len", "attention", "sp", "message"),
    [
        (Layout(cp=2), TEST_MODEL, 30, "ring", False, r"data.seq_len \(30\) is not divisible by 2·cp = 4"),
        (Layout(cp=2, tp=2), TEST_MODEL, 32, "ulysses", False, r"model.n_kv_heads \(2\) is not divisible by cp×tp"),
        (Layout(cp=4), TEST_MODEL.replace(n_heads=2, n_kv_heads=2), 32, "ulysses", False, r"model.n_heads \(2\)"),
        (Layout(cp=2), MISTRAL, 32, "ring", False, "not model.sliding_window"),
        (Layout(cp=2, tp=4), TEST_MODEL, 36, "ring", True, r"not divisible by cp×tp = 8 under sequence_parallel"),
    ],
)
def test_impossible_cp_layouts_are_one_line_errors(
    layout: Layout, cfg: ModelConfig, seq_len: int, attention: str, sp: bool, message: str
) -> None:
    with pytest.raises(LayoutError, match=message) as err:
        check_layout(
            LayoutSpec(cfg, layout, 8, 0, seq_len, ParallelOptions(sequence_parallel=sp, cp_attention=attention))
        )
    assert "\n" not in str(err.value)


def test_unknown_cp_attention_is_refused_by_the_options() -> None:
    with pytest.raises(InputError, match=r"^parallel.cp_attention: Input should be 'ring' or 'ulysses'$"):
        ParallelOptions(cp_attention="star")


def test_cp_layout_checks_pass_valid_layouts() -> None:
    assert check_layout(LayoutSpec(MHA_MODEL, Layout(cp=4), 8, 0, 32, ParallelOptions(cp_attention="ulysses"))) == 1
    assert (
        check_layout(
            LayoutSpec(TEST_MODEL, Layout(pp=2, cp=2, tp=2), 8, 2, 32, ParallelOptions(sequence_parallel=True))
        )
        == 4
    )


def test_plan_without_cp_hook_is_refused() -> None:
    model = Transformer(TEST_MODEL)
    with pytest.raises(PlanError, match="has no context_parallel pattern"):
        cpm.apply_context_parallel(model, ParallelPlan(name="bare"), group=None)
    with pytest.raises(PlanError, match="matches no module"):
        cpm.apply_context_parallel(model, ParallelPlan(name="x", context_parallel="decoder.*.attn"), group=None)
    with pytest.raises(PlanError, match=r"model.layers.0.mlp \(MLP\) has no replaceable `core`"):
        cpm.apply_context_parallel(model, ParallelPlan(name="x", context_parallel="model.layers.*.mlp"), group=None)


# ---- the attention cores, float64 ---------------------------------------------------------------------------
def _core_errors(attention: str, n_heads: int, n_kv_heads: int) -> list[float]:
    """Max |Δ| of the output and of dq, dk, dv (summed over ranks) against causal_attention on the
    whole sequence."""
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 16, 8
    cos, sin = (t.double() for t in rotary_tables(d, 64, 10000.0))
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (n_heads, n_kv_heads, n_kv_heads))
    grad = torch.randn(b, n_heads, s, d, generator=g, dtype=torch.float64)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*whole, cos, sin)
    out.backward(grad)
    cp, rank = dist.get_world_size(), dist.get_rank()
    pos = cpm.chunk_positions(s, cp, rank)
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    got = cpm.ContextParallelAttention(dist.group.WORLD, attention)(*local, cos, sin)
    got.backward(grad[:, :, pos])
    errors = [(got - out[:, :, pos]).abs().max().item()]
    for part, ref in zip(local, whole, strict=True):
        full = torch.zeros_like(ref.grad)
        full[:, :, pos] = part.grad
        dist.all_reduce(full)
        errors.append((full - ref.grad).abs().max().item())
    return errors


# ---- mutations --------------------------------------------------------------------------------------------
class KeptHop:
    """A ring hop that exchanged nothing: waiting returns the rank's own block."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


@contextlib.contextmanager
def ring_hop_dropped(call: int) -> Iterator[list]:
    """Hop number `call` of the run (0: layer 0's forward hop; 6 at cp=2 with four layers: the backward
    hop that brings the last layer's K/V gradient home) keeps its block instead of exchanging it."""
    fired: list = []
    original = cpm.ring_shift
    calls = [0]

    def shift(tensor: torch.Tensor, group: dist.ProcessGroup) -> object:
        calls[0] += 1
        if calls[0] - 1 == call:
            fired.append(1)
            return KeptHop(tensor.clone())
        return original(tensor, group)

    with _patched(cpm, "ring_shift", shift):
        yield fired


@contextlib.contextmanager
def data_chunks_in_plain_order() -> Iterator[list]:
    """The data side hands rank r the r-th contiguous slice, while rotary and mask expect chunks r, 2cp−1−r."""
    fired: list = []

    def shard(batch: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
        fired.append(1)
        return batch.chunk(cp, dim=1)[rank]

    with _patched(cpm, "shard_sequence", shard):
        yield fired


@contextlib.contextmanager
def rotary_chunks_in_plain_order() -> Iterator[list]:
    """Rotary positions of the r-th contiguous slice, while the tokens are chunks r and 2cp−1−r."""
    fired: list = []

    def positions(self: cpm.ContextParallelAttention, local_len: int, device: torch.device) -> torch.Tensor:
        fired.append(1)
        return torch.arange(self.rank * local_len, (self.rank + 1) * local_len, device=device)

    with _patched(cpm.ContextParallelAttention, "positions", positions):
        yield fired


@contextlib.contextmanager
def cp_gradients_not_reduced() -> Iterator[list]:
    """Gradients reduced over dp only: each cp rank steps on the gradient of its own tokens."""
    fired: list = []

    def dp_only(mesh):
        fired.append(1)
        return mesh.group("dp")

    with _patched(data_parallel, "replica_group", dp_only):
        yield fired


MUTATIONS = {
    "forward ring hop dropped": lambda: ring_hop_dropped(0),
    "backward K/V-gradient hop dropped": lambda: ring_hop_dropped(6),
    "data chunks in plain order": data_chunks_in_plain_order,
    "rotary chunks in plain order": rotary_chunks_in_plain_order,
    "cp gradients not reduced": cp_gradients_not_reduced,
}


# ---- spawned groups -----------------------------------------------------------------------------------------
def _checks(cores: list[tuple], runs: list[tuple[str, dict, dict]], mutations: list[str]) -> dict:
    out: dict = {"cores": [_core_errors(*c) for c in cores], "runs": _runs_only(runs), "mutated": []}
    for name in mutations:
        with MUTATIONS[name]() as fired:
            result = train_layout("cp=2", {}, steps=MUTATION_STEPS)
        out["mutated"].append({**result, "fired": len(fired)})
    return out


def _assert_cores(per_rank: list[dict]) -> None:
    # float64 throughout: the only differences are summation orders (~1e-16 relative on O(1) values)
    for rank in per_rank:
        for errors in rank["cores"]:
            assert max(errors) < 1e-12, errors


def _assert_runs(runs: list[tuple[str, dict, dict]], per_rank: list[dict]) -> None:
    for (layout, parallel, kwargs), got in zip(runs, per_rank[0]["runs"], strict=True):
        try:
            assert_close_runs(reference(**kwargs), got)
        except AssertionError as e:
            raise AssertionError(f"{layout} {parallel} {kwargs}: {e}") from None


RUNS_CP2 = [
    ("cp=2", {}, {}),
    ("cp=2", {"cp_attention": "ulysses"}, {}),
    ("cp=2", {}, {"optimizer": "sgd"}),
    ("cp=2", {"cp_attention": "ulysses"}, {"optimizer": "sgd"}),
]


def test_cp2_ring_and_ulysses_match_one_process() -> None:
    cores = [("ring", 4, 2), ("ring", 4, 4), ("ulysses", 4, 2)]
    out = run_shared(_checks, 2, cores, RUNS_CP2, list(MUTATIONS))
    _assert_cores(out)
    _assert_runs(RUNS_CP2, out)
    ref = reference(steps=MUTATION_STEPS)
    for name, mutated in zip(MUTATIONS, out[0]["mutated"], strict=True):
        assert sum(rank["mutated"][list(MUTATIONS).index(name)]["fired"] for rank in out) > 0, f"{name} never fired"
        assert "losses" in criterion_failures(ref, mutated), f"{name}: the loss criterion passed a run with the bug"


RUNS_CP4 = [
    ("cp=4", {}, {}),
    ("cp=4", {"cp_attention": "ulysses"}, {"model_cfg": MHA_MODEL}),
    ("dp=2,cp=2", {"zero": 1}, {}),
    ("cp=2,tp=2", {"sequence_parallel": True}, {"optimizer": "sgd"}),
]


@pytest.mark.slow  # four four-rank runs; cp+dp and cp+tp are in the fast tier's tests/parallel/test_compositions.py
def test_cp4_and_cp_with_dp_zero_tp_match_one_process() -> None:
    cores = [("ring", 4, 2), ("ulysses", 4, 4)]
    out = run_shared(_checks, 4, cores, RUNS_CP4, [])
    _assert_cores(out)
    _assert_runs(RUNS_CP4, out)


RUN_4D = [("pp=2,cp=2,tp=2", {}, {"micro_batch": 2})]


def _runs_only(runs: list[tuple[str, dict, dict]]) -> list[dict]:
    return [train_layout(lay, par, **kw) for lay, par, kw in runs]


@pytest.mark.slow  # eight fresh ranks on two cores: ~13 s
def test_4d_pp2_cp2_tp2_matches_one_process() -> None:
    out = run_distributed(_runs_only, 8, RUN_4D, timeout=300)
    assert_close_runs(reference(micro_batch=2), out[0][0])


# ---- activation memory: the planner's formula against the measurement -----------------------------------
def _activation_peak(seq_len: int, attention: str) -> int:
    """Peak saved-activation bytes of one forward of one sequence on this rank (a cp rank: its chunks)."""
    cp = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    layout = f"cp={cp}" if cp > 1 else ""
    mesh = build_mesh(parse_layout(layout, cp), "cpu")
    torch.manual_seed(0)
    model = parallelize(Transformer(MHA_MODEL), mesh, {"cp_attention": attention})
    x, y = global_batch(0, 1, seq_len, MHA_MODEL.vocab_size)
    with ActivationMeter(model) as meter:
        loss = model.loss_fn(model(model.seq_shard(x)), model.seq_shard(y))
    loss.backward()
    return meter.peak


def _planned_activations(seq_len: int, cp: int) -> float:
    w = Workload(MHA_MODEL, seq_len, 1, 1.0, precision="fp32")
    layer = layer_activation_bytes(MHA_MODEL, seq_len, 1, 1, False, "none", "fp32", True, "meshlm", cp)
    return MHA_MODEL.n_layers * layer + logits_bytes(w, Candidate(parse_layout(f"cp={cp}", cp)))


def test_planner_activation_memory_falls_as_one_over_cp_like_the_measured() -> None:
    seq_len = 64
    measured = {(1, "ring"): _activation_peak(seq_len, "ring")}
    for cp in (2, 4):
        for attention in ("ring", "ulysses"):
            measured[cp, attention] = max(run_shared(_activation_peak, cp, seq_len, attention))
    for (cp, attention), got in measured.items():
        want = _planned_activations(seq_len, cp)
        assert want == pytest.approx(_planned_activations(seq_len, 1) / cp)  # the formula: exactly 1/cp
        # The formula counts what each layer saves per token; the measurement also holds a few per-run
        # constants (the rotary tables, index tensors) and Ulysses' SDPA inputs in position order: measured
        # within 5% of it at cp = 1, 2, 4 (benchmarks/context_parallel.py, docs/benchmarks.md). Activations
        # not sharded over cp would be cp× the formula.
        assert abs(got / want - 1) < 0.08, (cp, attention, got, want)


def test_planner_cp_communication_counts_the_runtimes_hops() -> None:
    hw = hardware("h100")
    w = Workload(TEST_MODEL, 4096, 8, 1e9)
    kv = TEST_MODEL.n_kv_heads * TEST_MODEL.head_dim
    for cp in (2, 4):
        ring = Candidate(Layout(cp=cp, dp=8 // cp), micro_batch=1)
        tokens = 4096 / cp
        link = hw.link("cp", False, "send_recv")
        hop = 2 * tokens * kv * 2 / link.beta + link.alpha  # K and V, bf16, one send/recv
        grad_hop = 2 * tokens * kv * 4 / link.beta + link.alpha  # their fp32 gradient accumulator
        # nothing to hide behind (core_s = 0): every hop exposed
        assert cp_layer_time(TEST_MODEL, tokens, ring, hw, 2) == pytest.approx(2 * (cp - 1) * hop + cp * grad_hop)
        t = step_time(w, ring, hw)
        m = ring.micro_batches(w.global_batch)
        core = ring_core_time(w, ring, hw, DEFAULTS)
        assert t.cp_comm == pytest.approx(
            m * TEST_MODEL.n_layers * cp_layer_time(TEST_MODEL, tokens, ring, hw, 2, core)
        )
        assert "cp_comm" in t.parts() and t.total == pytest.approx(sum(v for k, v in t.parts().items() if k != "total"))
        ulysses = ring.with_options(cp_attention="ulysses")
        a2a = hw.link("cp", False, "all_to_all")
        nbytes = 2 * tokens * (TEST_MODEL.dim + kv) * 2
        want = 2 * ((cp - 1) / cp * nbytes / a2a.beta + (cp - 1) * a2a.alpha)
        assert cp_layer_time(TEST_MODEL, tokens, ulysses, hw, 2) == pytest.approx(want)
        # the ring runs its own block through the causal kernel and the visible half of the others unmasked:
        # the causal attention FLOPs, as Ulysses' SDPA (compared at one flash rate for every sequence length:
        # the planner prices the ring's seq/cp-long kernel calls at flash's shorter-sequence rate)
        big = Workload(preset("llama3-8b"), 8192, 16, 1e9)
        flat = dataclasses.replace(hw, attention_chip=None)
        assert step_time(big, ring, flat).compute == pytest.approx(step_time(big, ulysses, flat).compute)
    assert cp_layer_time(TEST_MODEL, 4096, Candidate(Layout(dp=8)), hw, 2) == 0.0
    assert "cp_comm" not in step_time(w, Candidate(Layout(dp=8)), hw).parts()


# ---- `meshlm train` -----------------------------------------------------------------------------------------
def test_trainer_under_cp_matches_single_process_and_resumes_under_dp(small_run: list[str], tmp_path: Path) -> None:
    steps = 4

    def args(run_dir: str, layout: str, *extra: str) -> list[str]:
        return [*small_run, "--log.run_dir", str(tmp_path / run_dir), "--parallel.layout", layout,
                "--train.steps", str(steps), "--train.eval_every", str(steps), "--log.every", "2", *extra]  # fmt: skip

    cfg = load_config(None, parse_overrides(small_run))
    prepare_data(cfg.data, cfg.model.build().vocab_size)  # tokenize once, before the ranks start
    reference = train(load_config(None, parse_overrides(args("ref", ""))))
    runs = {
        "cp=2 ring zero=1": args("ring", "cp=2", "--parallel.zero", "1"),
        "cp=2 ulysses": args("ulysses", "cp=2", "--parallel.cp_attention", "ulysses"),
        # the ring run's checkpoint (ZeRO-1 shards over dp × cp) resumes under dp=2 for two more steps
        "resume dp=2": args("ring", "dp=2", "--train.steps", str(steps + 2)),
    }
    results = dict(zip(runs, run_shared(trainer_runs, 2, list(runs.values()), timeout=400)[0], strict=True))
    for name in ("cp=2 ring zero=1", "cp=2 ulysses"):
        assert results[name]["losses"] == pytest.approx(reference.losses, rel=1e-5), name
        assert results[name]["eval"][-1][1] == pytest.approx(reference.eval_losses[-1][1], rel=1e-5), name
    assert results["resume dp=2"]["start"] == steps and len(results["resume dp=2"]["losses"]) == 2
    # the equal losses are cp's own: the ring's send/recv and Ulysses' all-to-alls ran (and were timed)
    for run_dir, collective in (("ring", "comm_p2p_s"), ("ulysses", "comm_all_to_all_s")):
        records = [json.loads(line) for line in (tmp_path / run_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get(collective, 0) > 0 for r in records if r["kind"] == "train"), run_dir


def test_trainer_refuses_impossible_cp_layout_before_work(small_run: list[str]) -> None:
    cfg = load_config(None, parse_overrides([*small_run, "--parallel.layout", "cp=3", "--data.seq_len", "64"]))
    with pytest.raises(LayoutError, match=r"data.seq_len \(64\) is not divisible by 2·cp = 6"):
        check_config(cfg, 3)
