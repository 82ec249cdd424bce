"""Pipeline parallelism: pure schedules and splitting in-process, then the executor on gloo ranks against the
single-process model (losses, weights, gradients), its composition with dp / tp, and its failure behaviour.

Every layout trains twice, as tests/equivalence.py says: AdamW (loss curve) and SGD (loss curve and final
weights). The equivalence checks share the session's gloo groups; the failure checks spawn their own."""

from __future__ import annotations

import copy
import itertools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, run_shared
from equivalence import TEST_MODEL, assert_close_runs, global_batch, reference, train_layout
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.model import Transformer
from meshlm.model.flops import part_costs
from meshlm.model.llama import cross_entropy_loss
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import Layout, LayoutError, build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.pp.pipeline import PipelineError, split_model
from meshlm.parallel.pp.schedules import (
    SCHEDULES,
    SENDS,
    WAITS,
    Action,
    ScheduleError,
    add_communication,
    add_send_waits,
    build_schedule,
    format_timeline,
    simulate,
    theoretical_bubble,
    validate,
)
from meshlm.parallel.pp.stages import stage_layers
from meshlm.parallel.strategies import check_layout

EIGHT_LAYERS = TEST_MODEL.replace(n_layers=8)


def allowed(p_max: int = 6, m_max: int = 13, v_max: int = 3):
    """Every (schedule, p, m, v) within the bounds that the config accepts (strategies.check_layout)."""
    for name, p, v, m in itertools.product(SCHEDULES, range(1, p_max + 1), range(1, v_max + 1), range(1, m_max + 1)):
        try:
            options = ParallelOptions(virtual_stages=v, schedule=name)
            check_layout(LayoutSpec(TEST_MODEL.replace(n_layers=p * v), Layout(pp=p), m, 1, options=options))
        except LayoutError:
            continue
        yield name, p, m, v


# ---- schedules (pure) ----------------------------------------------------------------------------------
def test_every_allowed_schedule_is_valid_deadlock_free_and_has_the_formula_bubble():
    count = 0
    for name, p, m, v in allowed():
        for forward_only in (False, True):
            schedule = build_schedule(name, p, m, v, forward_only)
            validate(schedule, p, m, v, forward_only)
            timeline = simulate(schedule, p, v)  # raises on deadlock
            if not forward_only:
                # The 1F1B family's formulas hold for any backward/forward ratio; ZB-H1's at equal F, B, W.
                for costs in (None,) if name == "zb1" else (None, {"F": 1.0, "B": 2.0}):
                    bubble = simulate(schedule, p, v, costs).bubble_fraction
                    assert bubble == pytest.approx(theoretical_bubble(name, p, m, v), abs=1e-12), (name, p, m, v)
            assert sum(a.kind in ("F", "B") for a in schedule[0]) == (1 if forward_only else 2) * m * v
            assert len(timeline.spans) == p
        count += 1
    assert count > 150


def test_zero_bubble_keeps_1f1b_peak_memory_and_thirds_its_bubble():
    for p, m in ((2, 4), (4, 8), (4, 5), (6, 13)):
        zb, one_f_one_b = (simulate(build_schedule(name, p, m), p, 1) for name in ("zb1", "1f1b"))
        assert max(zb.peak_in_flight) == max(one_f_one_b.peak_in_flight) == p  # W-pending activations count
        f_b_w = simulate(build_schedule("1f1b", p, m), p, 1, {"F": 1.0, "B": 2.0})  # B = input + weight grads
        assert zb.total == f_b_w.total - 2 * (p - 1)  # idle (p-1)(F+B+W) -> (p-1)(F+B-W), unit costs
        for ops in build_schedule("zb1", p, m):  # the input gradient goes out before its weight gradient runs
            kinds = [a.kind for a in ops]
            assert kinds.index("SEND_B") < kinds.index("W") if "SEND_B" in kinds else True


def test_bubble_formulas():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)


def test_1f1b_holds_at_most_p_activations_where_gpipe_holds_m():
    for p, m in [(2, 8), (4, 8), (4, 16), (3, 3)]:
        gpipe = simulate(build_schedule("gpipe", p, m), p, 1).peak_in_flight
        one_f_one_b = simulate(build_schedule("1f1b", p, m), p, 1).peak_in_flight
        assert gpipe == [m] * p
        assert one_f_one_b == [min(p - r, m) for r in range(p)]
    # interleaved trades some memory for its smaller bubble: Megatron's warm-up of 2(p-r-1) + (v-1)p forwards
    for p, v, m in itertools.product((2, 3, 4), (2, 3), (4, 8, 12)):
        if m % p == 0:
            assert simulate(build_schedule("interleaved", p, m, v), p, v).peak_in_flight == [
                min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)
            ]


def _max_pending_sends(schedule: list[list[Action]]) -> list[int]:
    peaks = []
    for ops in schedule:
        pending = peak = 0
        for a in ops:
            pending += (a.kind in SENDS) - (a.kind in WAITS)
            peak = max(peak, pending)
        peaks.append(peak)
    return peaks


def test_send_buffers_are_released_during_the_step_not_at_its_end():
    """A send's buffer (stage output, input gradient) is freed once the receiver provably used it, so with
    1F1B / interleaved the sends in flight stay bounded as m grows, like the activations themselves."""
    for name, p, v in [("1f1b", 4, 1), ("1f1b", 2, 1), ("interleaved", 4, 2), ("interleaved", 2, 3)]:
        few, many = (_max_pending_sends(build_schedule(name, p, m, v)) for m in (8, 32))
        assert few == many and max(many) <= 2 * p, (name, p, v, few, many)
    assert _max_pending_sends(build_schedule("gpipe", 4, 32)) == [32] * 4  # GPipe holds everything anyway


def test_interleaved_chunks_cycle_in_groups_of_p_micro_batches():
    computes = [a for a in build_schedule("interleaved", 2, 4, 2)[0] if a.kind in ("F", "B")]
    assert [a.label(2) for a in computes[:6]] == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "B0.1"]


def test_format_timeline_shows_bubbles():
    text = format_timeline(simulate(build_schedule("1f1b", 2, 3), 2, 1))
    assert text == (
        "rank 0 | F0 F1  . B0 F2 B1  . B2\n"  # warm-up of one forward, then one-forward-one-backward
        "rank 1 |  . F0 B0 F1 B1 F2 B2  ."
    )
    assert format_timeline(simulate(build_schedule("gpipe", 2, 2), 2, 1, {"F": 1, "B": 2})).splitlines()[0] == (
        "rank 0 | F0 F1  .  .  . B0  ~ B1  ~"
    )


def _broken(schedule: list[list[Action]], rank: int, change) -> list[list[Action]]:
    out = [list(ops) for ops in schedule]
    change(out[rank])
    return out


def test_validate_rejects_broken_schedules():
    good = build_schedule("1f1b", 2, 4)
    validate(good, 2, 4, 1)
    send = next(i for i, a in enumerate(good[0]) if a.kind == "SEND_F")
    recv = next(i for i, a in enumerate(good[1]) if a.kind == "RECV_F")
    first_b = next(i for i, a in enumerate(good[0]) if a.kind == "B")

    def swap_sends(ops):
        i, j = [k for k, a in enumerate(ops) if a.kind == "SEND_F"][:2]
        ops[i], ops[j] = ops[j], ops[i]

    broken = {
        "dropped send": _broken(good, 0, lambda ops: ops.pop(send)),
        "send never waited": _broken(good, 0, lambda ops: ops.remove(Action("WAIT_F", 0, 0, 1))),
        "wait before send": _broken(good, 0, lambda ops: ops.insert(0, Action("WAIT_F", 0, 0, 1))),
        "sends out of order": _broken(good, 0, swap_sends),
        "receive after use": _broken(good, 1, lambda ops: ops.append(ops.pop(recv))),
        "backward before forward": _broken(good, 0, lambda ops: ops.insert(0, ops.pop(first_b))),
        "wrong peer": _broken(good, 0, lambda ops: ops.__setitem__(send, Action("SEND_F", 0, 0, 0))),
        "missing compute": _broken(good, 1, lambda ops: ops.remove(Action("F", 0, 3))),
        "micro out of range": _broken(good, 0, lambda ops: ops.append(Action("F", 0, 9))),
    }
    for what, schedule in broken.items():
        with pytest.raises(ScheduleError):
            validate(schedule, 2, 4, 1)
            pytest.fail(f"validate accepted a schedule with a {what}")


def test_simulate_detects_deadlock():
    # rank 0 waits for B0's gradient before sending F1; rank 1 runs F1 before B0: a cycle.
    orders = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)],
    ]
    schedule = add_communication(orders, 2, 1)  # every input is received before use, in order...
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule, 2, 1)  # ...but the step never finishes
    with pytest.raises(ScheduleError, match="deadlock"):
        add_send_waits(schedule, 2, 1)


def test_unknown_or_inconsistent_schedule_names():
    with pytest.raises(ScheduleError, match="unknown"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="interleaved"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="divisible"):
        build_schedule("interleaved", 2, 3, 2)


# ---- splitting (in-process) ----------------------------------------------------------------------------
@pytest.mark.parametrize("p,v,n_layers", [(2, 1, 4), (4, 1, 4), (2, 2, 4), (2, 2, 8), (4, 2, 8), (3, 1, 8)])
def test_chunks_partition_the_model_and_compose_to_it(p, v, n_layers):
    torch.manual_seed(0)
    model = Transformer(TEST_MODEL.replace(n_layers=n_layers))
    tokens = torch.randint(0, TEST_MODEL.vocab_size, (2, 16))
    expected = model(tokens)
    per_rank = [split_model(model, r, p, v) for r in range(p)]
    ranges = stage_layers(model.cfg, p * v)
    names = []
    h = tokens
    for stage in range(p * v):
        chunk = per_rank[stage % p][stage // p]  # chunk c of rank r is stage c·p + r
        assert [int(k) for k in chunk.model.layers] == list(ranges[stage])
        assert (chunk.model.embed_tokens is not None) == (stage == 0)
        assert (chunk.lm_head is not None) == (chunk.model.norm is not None) == (stage == p * v - 1)
        names += [n for n, _ in chunk.named_parameters()]
        h = chunk(h)
    assert torch.equal(h, expected)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each parameter on exactly one stage
    chunk_param = dict(per_rank[0][0].named_parameters())["model.embed_tokens.weight"]
    assert chunk_param is model.model.embed_tokens.weight  # shared, not copied


def test_stage_layers_balance_and_explicit_boundaries():
    cfg = TEST_MODEL.replace(n_layers=8, vocab_size=4096)  # head ≈ 1.4 layers of FLOPs, embedding ≈ 3 of params
    assert [len(r) for r in stage_layers(cfg, 4)] == [2, 2, 3, 1]
    assert [len(r) for r in stage_layers(cfg, 4, cost="params")] == [1, 3, 3, 1]
    assert stage_layers(cfg, 3, boundaries=[1, 5]) == [range(0, 1), range(1, 5), range(5, 8)]
    for bad in ([5, 1], [0, 4], [4], [2, 4, 8]):
        with pytest.raises(ValueError, match="boundaries"):
            stage_layers(cfg, 3, boundaries=bad)
    with pytest.raises(ValueError, match="each stage needs a layer"):
        stage_layers(cfg, 9)
    with pytest.raises(ValueError, match="flops"):
        part_costs(cfg, "bytes")


@settings(max_examples=40, deadline=None)
@given(
    n_layers=st.integers(1, 9),
    n_stages=st.integers(1, 9),
    embed=st.floats(0, 5),
    head=st.floats(0, 5),
    vocab=st.sampled_from([64, 256, 4096]),
)
def test_stage_layers_minimises_the_worst_stage(n_layers, n_stages, embed, head, vocab):
    """Against brute force over all contiguous splits, for both cost models."""
    if n_stages > n_layers:
        return
    cfg = TEST_MODEL.replace(n_layers=n_layers, vocab_size=vocab)
    for cost in ("flops", "params"):
        e, layer, h = part_costs(cfg, cost)

        def worst(ranges, e=e, layer=layer, h=h):
            costs = [len(r) * layer for r in ranges]
            costs[0] += e
            costs[-1] += h
            return max(costs)

        best = min(
            worst([range(a, b) for a, b in itertools.pairwise([0, *cuts, n_layers])])
            for cuts in itertools.combinations(range(1, n_layers), n_stages - 1)
        )
        ranges = stage_layers(cfg, n_stages, cost=cost)
        assert [i for r in ranges for i in r] == list(range(n_layers)) and all(ranges)
        assert worst(ranges) == pytest.approx(best)


# ---- the executor on gloo ranks -----------------------------------------------------------------------
def _one_step(layout: str, par: dict, n_micro: int, model_cfg, seq_len: int = 16) -> dict:
    """One forward/backward under `layout` next to the same model run whole on this rank: loss and gradient
    differences, the eval loss, the measured peak of in-flight activations and the grad-sync requests."""
    world = dist.get_world_size()
    mesh = build_mesh(parse_layout(layout, world), "cpu")
    torch.manual_seed(0)
    model = Transformer(model_cfg)
    reference = copy.deepcopy(model)
    pm = parallelize(model, mesh, {**par, "micro_batches": n_micro})
    x, y = global_batch(1, 2 * n_micro, seq_len, model_cfg.vocab_size)
    grad_sync: list[tuple[int, bool]] = []  # no dp here: record what the pipeline asks of it instead
    pm.pipeline.set_grad_sync = lambda chunk, enabled: grad_sync.append((chunk, enabled))
    loss = pm.forward_backward(x, y).item()
    stats = pm.pipeline.stats
    eval_loss = pm.eval_loss(x, y).item()
    ref_loss = cross_entropy_loss(reference(x), y)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    grad_diff = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pm.named_parameters())
    return {
        "loss": (loss, ref_loss.item()),
        "eval_loss": (eval_loss, ref_loss.item()),
        "grad_diff": grad_diff,
        "peak": stats.peak_in_flight,
        "grad_sync": grad_sync,
    }


OPTIMIZERS = ("adamw", "sgd")


def _train_both(layout: str, par: dict, micro_batch: int, cfg=TEST_MODEL) -> dict[str, dict]:
    return {
        opt: train_layout(layout, par, micro_batch=micro_batch, model_cfg=cfg, seq_len=16, optimizer=opt)
        for opt in OPTIMIZERS
    }


def _assert_matches_reference(got: dict[str, dict], cfg=TEST_MODEL, label: object = "") -> None:
    for opt in OPTIMIZERS:
        try:
            assert_close_runs(reference(model_cfg=cfg, seq_len=16, optimizer=opt), got[opt])
        except AssertionError as e:
            raise AssertionError(f"{label} {opt}: {e}") from None


def _grid_and_equivalence(grid: list, runs: list) -> dict:
    return {"grid": [_one_step(*case) for case in grid], "runs": [_train_both(*run) for run in runs]}


def _check_grid(grid: list, results: list[list[dict]]) -> None:
    p = len(results)
    for i, (layout, par, n_micro, _) in enumerate(grid):
        name, v = par["schedule"], par.get("virtual_stages", 1)
        expected_peak = simulate(build_schedule(name, p, n_micro, v), p, v).peak_in_flight
        for rank, per_rank in enumerate(results):
            got = per_rank["grid"][i]
            case = (layout, par, n_micro, rank)
            assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-6), case
            assert got["eval_loss"][0] == pytest.approx(got["eval_loss"][1], rel=1e-6), case
            assert got["grad_diff"] < 1e-6, case
            assert got["peak"] == expected_peak[rank], case
            for chunk in range(v):  # one call before each backward; only the chunk's last one syncs dp
                assert [e for c, e in got["grad_sync"] if c == chunk] == [False] * (n_micro - 1) + [True], case


def test_pp2_every_schedule_matches_single_process():
    """10 steps of each schedule with 4 micro-batches (and 8 for 1F1B), plus one checked step for a grid of
    micro-batch counts (no deadlock, exact loss, gradients, eval loss and in-flight peak)."""
    grid = [("pp=2", {"schedule": "gpipe"}, m, TEST_MODEL) for m in (1, 2, 3)]
    grid += [("pp=2", {"schedule": "1f1b"}, m, TEST_MODEL) for m in (2, 3, 5, 8)]
    grid += [("pp=2", {"schedule": "interleaved", "virtual_stages": 2}, m, TEST_MODEL) for m in (2, 4, 8)]
    grid += [("pp=2", {"schedule": "zb1"}, m, TEST_MODEL) for m in (2, 3, 5)]
    runs = [
        ("pp=2", {"schedule": "gpipe"}, 2, TEST_MODEL),
        ("pp=2", {"schedule": "1f1b"}, 2, TEST_MODEL),
        ("pp=2", {"schedule": "1f1b"}, 1, TEST_MODEL),
        ("pp=2", {"schedule": "interleaved", "virtual_stages": 2}, 2, TEST_MODEL),
        ("pp=2", {"schedule": "zb1"}, 2, TEST_MODEL),
    ]
    results = run_shared(_grid_and_equivalence, 2, grid, runs)
    _check_grid(grid, results)
    for i, run in enumerate(runs):
        for rank, per_rank in enumerate(results):
            _assert_matches_reference(per_rank["runs"][i], TEST_MODEL, (rank, *run[:3]))


@pytest.mark.slow  # every schedule's grid on four ranks: ~13 s
def test_pp4_every_schedule_matches_single_process():
    grid = [("pp=4", {"schedule": "gpipe"}, m, EIGHT_LAYERS) for m in (2, 4)]
    grid += [("pp=4", {"schedule": "1f1b"}, m, EIGHT_LAYERS) for m in (4, 5)]
    grid += [("pp=4", {"schedule": "interleaved", "virtual_stages": 2}, m, EIGHT_LAYERS) for m in (4, 8)]
    grid += [("pp=4", {"schedule": "zb1"}, m, EIGHT_LAYERS) for m in (4, 5)]
    runs = [
        ("pp=4", {"schedule": "gpipe"}, 2, EIGHT_LAYERS),
        ("pp=4", {"schedule": "1f1b"}, 1, EIGHT_LAYERS),
        ("pp=4", {"schedule": "interleaved", "virtual_stages": 2}, 2, EIGHT_LAYERS),
        ("pp=4", {"schedule": "zb1"}, 1, EIGHT_LAYERS),
    ]
    results = run_shared(_grid_and_equivalence, 4, grid, runs)
    _check_grid(grid, results)
    for i, run in enumerate(runs):
        _assert_matches_reference(results[0]["runs"][i], EIGHT_LAYERS, run[:3])


def _compositions(runs: list) -> list[dict]:
    return [_train_both(*run) for run in runs]


@pytest.mark.slow  # five compositions on four ranks: ~12 s
def test_pp_with_dp_and_zero():
    pytest.importorskip("meshlm.parallel.dp.data_parallel")
    runs = [
        ("pp=2,dp=2", {"schedule": "1f1b"}, 2),
        ("pp=2,dp=2", {"schedule": "gpipe", "zero": 1}, 1),
        ("pp=2,dp=2", {"schedule": "zb1", "zero": 2}, 1),  # dp's reduce hooks fire in the W pass
        ("pp=2,dp=2", {"schedule": "zb1", "zero": 3}, 1),  # and ZeRO-3's re-gathers run in both passes
        # 2 micro-batches: F0 B0 F1 B1 W0 W1 on the last stage; W0 frees the units, W1 must gather them again
        ("pp=2,dp=2", {"schedule": "zb1", "zero": 3}, 2),
    ]
    for run, got in zip(runs, run_shared(_compositions, 4, runs)[0], strict=True):
        _assert_matches_reference(got, TEST_MODEL, run)


@pytest.mark.slow  # ~6,000 collectives on four ranks: ~19 s
def test_pp_with_tp_and_sequence_parallel():
    pytest.importorskip("meshlm.parallel.tp.sharding")
    runs = [
        ("pp=2,tp=2", {"schedule": "1f1b"}, 2),
        ("pp=2,tp=2", {"schedule": "interleaved", "virtual_stages": 2, "sequence_parallel": True}, 2),
        ("pp=2,tp=2", {"schedule": "zb1", "sequence_parallel": True}, 1),
    ]
    for run, got in zip(runs, run_shared(_compositions, 4, runs)[0], strict=True):
        _assert_matches_reference(got, TEST_MODEL, run)


@pytest.mark.slow  # eight ranks on two cores
def test_pp_dp_tp_world_8():
    pytest.importorskip("meshlm.parallel.dp.data_parallel")
    pytest.importorskip("meshlm.parallel.tp.sharding")
    runs = [("pp=2,dp=2,tp=2", {"schedule": "1f1b"}, 2)]
    _assert_matches_reference(run_shared(_compositions, 8, runs)[0][0], TEST_MODEL, runs[0])


# ---- failures end every rank with a clear error ---------------------------------------------------------
PG_TIMEOUT = 4.0
SLACK = 6.0  # process teardown on a loaded 2-core machine


def _failing_step(mode: str, bad_rank: int, out_dir: str) -> None:
    """pp = world, 1F1B, 4 micro-batches; `bad_rank` raises in (or exits before) the forward of micro-batch 2,
    or silently drops a send. Every rank records what happened to it and when."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(parse_layout(f"pp={world}", world), "cpu")
    torch.manual_seed(0)
    pm = parallelize(Transformer(TEST_MODEL), mesh, {"micro_batches": 4})
    if rank == bad_rank and mode == "drop":
        actions = pm.pipeline.actions
        send = next(a for a in actions if a.kind.startswith("SEND") and a.micro == 1)
        actions.remove(send)
        actions.remove(Action("WAIT" + send.kind[4:], send.chunk, send.micro, send.peer))
    elif rank == bad_rank:
        calls = []

        def fail(module, args):
            if len(calls) == 2:
                if mode == "exit":
                    os._exit(3)
                raise ValueError("injected failure")
            calls.append(1)

        pm.chunks[0].register_forward_pre_hook(fail)
    x, y = global_batch(0, 8, 16, TEST_MODEL.vocab_size)
    start = time.perf_counter()
    try:
        pm.forward_backward(x, y)
        outcome = "finished"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    Path(out_dir, f"rank{rank}.txt").write_text(f"{time.perf_counter() - start}\n{outcome}")


def _outcomes(mode: str, world: int, bad_rank: int, tmp_path: Path) -> dict[int, tuple[float, str]]:
    try:
        run_distributed(_failing_step, world, mode, bad_rank, str(tmp_path), pg_timeout=PG_TIMEOUT, timeout=90)
    except RuntimeError as e:
        assert mode == "exit" and "died without a result" in str(e)
    out = {}
    for r in range(world):
        path = tmp_path / f"rank{r}.txt"
        if path.exists():
            elapsed, outcome = path.read_text().split("\n", 1)
            out[r] = (float(elapsed), outcome)
    return out


def _assert_clean_pipeline_errors(outcomes: dict, ranks: list[int]) -> None:
    for r in ranks:
        elapsed, outcome = outcomes[r]
        assert outcome.startswith(PipelineError.__name__), (r, outcome)
        assert "pipeline stage" in outcome and "micro-batch" in outcome, (r, outcome)
        assert elapsed < PG_TIMEOUT + SLACK, (r, elapsed, outcome)


def test_a_rank_raising_mid_pipeline_fails_every_rank_within_the_timeout(tmp_path):
    outcomes = _outcomes("raise", 4, 2, tmp_path)
    assert outcomes[2][1] == "ValueError: injected failure"
    _assert_clean_pipeline_errors(outcomes, [0, 1, 3])


def test_a_rank_exiting_mid_pipeline_fails_every_rank_within_the_timeout(tmp_path):
    outcomes = _outcomes("exit", 3, 1, tmp_path)
    assert 1 not in outcomes
    _assert_clean_pipeline_errors(outcomes, [0, 2])


def test_a_lost_message_times_out_instead_of_hanging(tmp_path):
    outcomes = _outcomes("drop", 2, 0, tmp_path)
    _assert_clean_pipeline_errors(outcomes, [0, 1])
    assert any("Timed out" in outcome or "timed out" in outcome for _, outcome in outcomes.values())
