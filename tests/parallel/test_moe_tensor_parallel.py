"""Tensor parallelism inside mixture-of-experts layers (meshlm.parallel.tp.moe) and ep × tp: the plan tables, bad
layouts in one line, training like one process at tp=2 (± sequence parallel) and ep=2×tp=2, mutations that
must fail, meta-built weights, and a checkpoint saved at ep=2×tp=2 resumed in one process."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from distributed import run_shared
from equivalence import (
    _patched,
    assert_close_runs,
    assert_identical_weights,
    criterion_failures,
    reference,
    tail,
    train_layout,
)
from test_expert_parallel import assert_starts_like_one_process, meta_built, train_moe_runs
from test_moe import MOE_MODEL

from meshlm.model import Transformer
from meshlm.model import init as element_init
from meshlm.model.init import Normal, fill_
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.parallel_plan import PlanError, SplitMoE
from meshlm.parallel.plan_registry import MOE_LAYER, plan_for
from meshlm.parallel.strategies import check_layout

SAVED_AT = 5  # the ep=2×tp=2 checkpoint's step, resumed in one process


# ---- plans, layouts and bad input ----------------------------------------------------------------------------------
def test_moe_layers_get_the_moe_style_and_dense_layers_the_mlp_pair() -> None:
    with torch.device("meta"):
        model = Transformer(MOE_MODEL)  # layer 0 dense (first_k_dense=1), layers 1-3 MoE
    table = plan_for(model).tensor_parallel
    split = [pattern for pattern, style in table.items() if isinstance(style, SplitMoE)]
    assert split == [f"model.layers.{i}.mlp" for i in (1, 2, 3)]
    assert "model.layers.*.mlp.gate_proj" in table  # the dense layer's colwise/rowwise pair
    options = ParallelOptions(zero=3, sequence_parallel=True)
    check_layout(LayoutSpec(None, Layout(tp=2, pp=2), 2, 1, options=options), model)
    with torch.device("meta"):
        all_moe = Transformer(MOE_MODEL.replace(first_k_dense=0))
    assert plan_for(all_moe).tensor_parallel["model.layers.*.mlp"] == MOE_LAYER
    assert not any(".mlp." in p for p in plan_for(all_moe).tensor_parallel)  # no pattern matching nothing


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moe_intermediate_size": 34}, "model.moe_intermediate_size (34) is not divisible by tp=4"),
        (
            {"shared_expert_intermediate_size": 34},
            "model.shared_expert_intermediate_size (34) is not divisible by tp=4",
        ),
    ],
)
def test_expert_widths_not_divisible_by_tp_are_one_line(changes: dict, message: str) -> None:
    cfg = MOE_MODEL.replace(**changes)
    for layout, world in (("tp=4", 4), ("ep=2,tp=4", 8)):
        with pytest.raises(LayoutError) as e:
            check_layout(LayoutSpec(cfg, parse_layout(layout, world), 8, seq_len=32))
        assert str(e.value) == message
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(PlanError) as e:  # the plan check names the module (a config of one's own skips the above)
        check_layout(LayoutSpec(None, Layout(tp=4), 1), model)
    assert "module model.layers.1.mlp (MoE, moe)" in str(e.value) and "\n" not in str(e.value)
    assert "is not divisible by tp=4" in str(e.value)


@pytest.mark.parametrize(
    ("pattern", "style", "message"),
    [
        ("model.layers.0.mlp", MOE_LAYER, r"module model.layers.0.mlp \(MLP, moe\): SplitMoE splits a mixture-of-exp"),
        ("model.layers.1.mlp", SplitMoE((("experts.gate", 1),)), r"SplitMoE names 'experts.gate', which is no param"),
        ("model.layers.1.mlp", SplitMoE((("router.weight", 0),)), r"SplitMoE names 'router.weight', which is no par"),
        ("model.layers.1.mlp", SplitMoE((("gate.weight", 2),)), r"gate.weight \(4, 64\) has no dim 2; valid: 0..1$"),
    ],
)
def test_bad_moe_styles_are_one_line(pattern: str, style: SplitMoE, message: str) -> None:
    with torch.device("meta"):
        model = Transformer(MOE_MODEL)
    plan = plan_for(model)
    bad = dataclasses.replace(plan, tensor_parallel={**plan.tensor_parallel, pattern: style})
    with pytest.raises(PlanError, match=message) as e:
        check_layout(LayoutSpec(None, Layout(tp=2), 1), model, bad)
    assert "\n" not in str(e.value)


def test_expert_init_slices_over_ep_and_tp_are_the_full_tensors_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """fill_ of an expert weight's slice along dim 0 (ep) and dim 1 or 2 (tp), from any flat start: the same
    elements as the whole tensor's."""
    monkeypatch.setattr(element_init, "BLOCK_ELEMENTS", 64)  # two experts (rows of 30) per generated block
    shape, rule = (4, 6, 5), Normal(0.02)
    whole = fill_(torch.empty(120), rule, 3, "w", shape).view(shape)
    for tp_dim, local in ((1, (2, 3, 5)), (2, (2, 6, 2))):  # experts 2-3, and 3 of 6 or 2 of 5 hidden units
        offsets = ((0, 2), (tp_dim, 1))
        want = whole.narrow(0, 2, 2).narrow(tp_dim, 1, local[tp_dim]).reshape(-1)
        for start in (0, 7):
            got = fill_(torch.empty(want.numel() - start), rule, 3, "w", shape, local, offsets, start)
            assert torch.equal(got, want[start:])
    with pytest.raises(ValueError, match=r"^w: slice \(2, 6, 5\) at \(\(0, 3\),\) is outside the parameter"):
        fill_(torch.empty(60), rule, 3, "w", shape, (2, 6, 5), ((0, 3),))


# ---- training like one process -------------------------------------------------------------------------------------
@contextlib.contextmanager
def routed_output_reduced_twice() -> Iterator[list]:
    """The bug: the MoE layer's partial output is all-reduced twice (the tp reduction done by the experts and
    again after the combine), so it is tp times too large."""
    from meshlm.parallel.tp import moe as tp_moe

    fired: list = []
    original = tp_moe.reduce_from_tp

    def twice(x: torch.Tensor, group: object) -> torch.Tensor:
        fired.append(1)
        return original(original(x, group), group)

    with _patched(tp_moe, "reduce_from_tp", twice):
        yield fired


@contextlib.contextmanager
def router_gradient_not_summed() -> Iterator[list]:
    """The bug: the router's gradient keeps this tp rank's share (what its partial outputs send back)."""
    from meshlm.parallel.tp import moe as tp_moe

    fired: list = []

    def kept(grad: torch.Tensor, group: object) -> torch.Tensor:
        fired.append(1)
        return grad

    with _patched(tp_moe, "_all_reduce", kept):
        yield fired


@contextlib.contextmanager
def aux_gradient_added_on_every_tp_rank() -> Iterator[list]:
    """The bug: every tp rank adds the whole aux-loss gradient, which the router's sum over tp then counts tp
    times."""
    from meshlm.parallel.tp.moe import TensorParallelMoE

    fired: list = []
    original = TensorParallelMoE.__init__

    def unsplit(self: TensorParallelMoE, *args: object) -> None:
        original(self, *args)
        fired.append(1)
        self.aux_loss_split = 1

    with _patched(TensorParallelMoE, "__init__", unsplit):
        yield fired


MUTATIONS = {
    "reduced twice": routed_output_reduced_twice,
    "router share": router_gradient_not_summed,
    "aux on every rank": aux_gradient_added_on_every_tp_rank,
}
RUNS2 = {  # name -> (layout, parallel, train_layout kwargs), on 2 ranks
    "tp2": ("tp=2", {}, {}),
    "tp2 sp zero1": ("tp=2", {"sequence_parallel": True, "zero": 1}, {}),
    "tp2 sp sgd": ("tp=2", {"sequence_parallel": True}, {"optimizer": "sgd"}),
    "tp2 sp zero3": ("tp=2", {"sequence_parallel": True, "zero": 3}, {}),
}
RUNS4 = {
    "ep2 tp2 zero1": ("ep=2,tp=2", {"zero": 1}, {}),
    "ep2 tp2 sp zero1": ("ep=2,tp=2", {"zero": 1, "sequence_parallel": True}, {}),
    "ep2 tp2 zero1 sgd": ("ep=2,tp=2", {"zero": 1}, {"optimizer": "sgd"}),
    "pp2 tp2": ("pp=2,tp=2", {}, {"micro_batch": 2}),  # MoE layers on both stages, split over tp
}


def world2_job() -> dict:
    out = train_moe_runs(RUNS2)
    out["meta tp2 zero0"] = meta_built("tp=2", 0)
    for bug, mutation in MUTATIONS.items():
        with mutation() as fired:
            out[bug] = train_layout("tp=2", {}, model_cfg=MOE_MODEL)
        out[bug]["fired"] = len(fired)
    return out


def world4_job(checkpoint_dir: str) -> dict:
    out = train_moe_runs(RUNS4)
    out["meta ep2 tp2 zero1"] = meta_built("ep=2,tp=2", 1)
    out["saved"] = train_layout("ep=2,tp=2", {"zero": 1}, model_cfg=MOE_MODEL, stop=SAVED_AT, save_to=checkpoint_dir)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("eptp-checkpoint"))


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_shared(world2_job, 2, timeout=600)[0]


@pytest.fixture(scope="module")
def world4(checkpoint_dir: str) -> dict:
    return run_shared(world4_job, 4, checkpoint_dir, timeout=900)[0]


def _reference(kwargs: dict) -> dict:  # one process, no accumulation: the aux losses do not depend on it
    return reference(model_cfg=MOE_MODEL, **{k: v for k, v in kwargs.items() if k != "micro_batch"})


@pytest.mark.slow  # seven 10-step runs and a meta build on two spawned ranks: ~9 s on an idle 2-core VM, more loaded
@pytest.mark.parametrize("name", list(RUNS2))
def test_tp2_moe_trains_like_one_process(world2: dict, name: str) -> None:
    assert_close_runs(_reference(RUNS2[name][2]), world2[name])


@pytest.mark.slow  # four runs, a meta build and a 5-step save on four spawned ranks: ~9 s idle, more loaded
@pytest.mark.parametrize("name", list(RUNS4))
def test_ep2_tp2_trains_like_one_process(world4: dict, name: str) -> None:
    assert_close_runs(_reference(RUNS4[name][2]), world4[name])


@pytest.mark.slow  # shares the fixtures above
@pytest.mark.parametrize("name", ["meta tp2 zero0", "meta ep2 tp2 zero1"])
def test_meta_built_moe_starts_bit_identical_to_one_process(world2: dict, world4: dict, name: str) -> None:
    """Each rank fills only its slice of each expert (its experts over ep, its hidden units over tp)."""
    assert_starts_like_one_process({**world2, **world4}[name])


@pytest.mark.slow  # shares the world2 fixture
@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_tp_moe_bugs_fail_the_loss_criterion(world2: dict, bug: str) -> None:
    """The routed output reduced twice over tp, the router's gradient left a per-rank share, and the aux-loss
    gradient added whole on every tp rank each change the loss curve (`fired`: the bug ran on this rank)."""
    got = world2[bug]
    assert got["fired"]
    assert "losses" in criterion_failures(_reference({}), got)


@pytest.mark.slow  # shares the world4 fixture, plus a 5-step run in one process
def test_ep2_tp2_checkpoint_resumes_in_one_process(world4: dict, checkpoint_dir: str) -> None:
    """Saved at ep=2×tp=2 ZeRO-1 (each expert weight a box of the full tensor, placed over ep along dim 0 and over
    tp along its hidden dim), resumed in one process: the weights load bit for bit and the curve continues."""
    resumed = train_layout("", model_cfg=MOE_MODEL, start=SAVED_AT, resume_from=checkpoint_dir)
    assert_identical_weights(world4["saved"]["state"], resumed["resumed_state"])
    assert_close_runs(tail(_reference({}), SAVED_AT), resumed)
