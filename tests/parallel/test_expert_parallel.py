"""Expert parallelism (meshlm.parallel.ep.experts): the `ep` mesh dimension, all-to-all dispatch and
combine, per-parameter gradient reduction groups, checkpoints that reshard across ep sizes, and bad input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import (
    assert_close_runs,
    assert_identical_weights,
    criterion_failures,
    reference,
    tail,
    train_layout,
)
from test_moe import MOE_MODEL

from meshlm.model import Transformer, preset
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import Layout, LayoutError, build_mesh, parse_layout
from meshlm.parallel.strategies import check_layout

SAVED_AT = 5  # the ep=2 checkpoint's step; resumed at ep=1 and ep=4 for the remaining steps


# ---- layouts and bad input ---------------------------------------------------------------------------------------
def test_layouts_with_ep() -> None:
    assert parse_layout("ep=2", 2) == Layout(ep=2)
    assert parse_layout("dp=2,ep=2", 4) == Layout(dp=2, ep=2)
    assert parse_layout("ep=2", 8) == Layout(dp=4, ep=2)  # dp takes what the world leaves
    assert str(Layout(dp=2, ep=2)) == "pp=1,dp=2,ep=2,tp=1" and str(Layout(dp=2)) == "pp=1,dp=2,tp=1"
    assert Layout(dp=2, ep=2).data_parallel == 4  # the global batch splits over dp × ep
    assert check_layout(LayoutSpec(MOE_MODEL, Layout(dp=2, ep=2), 8, 1)) == 2


@pytest.mark.parametrize(
    ("layout", "world", "model", "batch", "message"),
    [
        ("ep=3", 3, MOE_MODEL, 6, "model.n_experts (4) is not divisible by ep=3"),
        ("ep=2", 2, preset("test"), 8, "parallel.layout ep=2 needs a mixture-of-experts model (model.n_experts > 0)"),
        ("dp=2,ep=2", 8, MOE_MODEL, 8, "pp×dp×ep×cp×tp = 4 but the world size is 8"),
        ("ep=4", 6, MOE_MODEL, 8, "pp×ep×cp×tp = 4 does not divide the world size 6"),
        ("dp=2,ep=2", 4, MOE_MODEL, 6, "train.global_batch (6) is not divisible by dp×ep=4"),
    ],
)
def test_bad_ep_layouts_are_one_line(layout: str, world: int, model: object, batch: int, message: str) -> None:
    with pytest.raises(LayoutError) as e:
        check_layout(LayoutSpec(model, parse_layout(layout, world), batch, seq_len=32))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_ep_composes_with_pp_and_cp() -> None:
    assert check_layout(LayoutSpec(MOE_MODEL, Layout(pp=2, ep=2), 8, 2, 32)) == 2
    assert check_layout(LayoutSpec(MOE_MODEL, Layout(ep=2, cp=2), 8, 1, 32)) == 4


def test_hybrid_shard_blocks_nest_the_expert_groups() -> None:
    """dp=2 × ep=2, ranks (dp, ep) dp-major; expert groups {0, 2} and {1, 3}. Blocks of 2 ({0, 1}, {2, 3}):
    each expert group has one rank per block, so experts are replicated over dp and all-reduced; one block of
    4: sharded over the whole group, no replicas."""
    from meshlm.parallel.dp.zero import nested_shard_lists

    assert nested_shard_lists([(0, 2), (1, 3)], [(0, 1), (2, 3)]) == ([[0], [2], [1], [3]], [[0, 2], [1, 3]])
    assert nested_shard_lists([(0, 2), (1, 3)], [(0, 1, 2, 3)]) == ([[0, 2], [1, 3]], [])
    # dp=4 × ep=2, blocks of 4: each expert group of 4 is cut into shards of 2, replicated twice
    groups, blocks = [(0, 2, 4, 6), (1, 3, 5, 7)], [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert nested_shard_lists(groups, blocks) == ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])


def test_hybrid_shard_blocks_that_cut_expert_groups_unevenly_are_one_line() -> None:
    """dp=3 × ep=2 with zero_shard_size 3: blocks {0, 1, 2} and {3, 4, 5} hold 2 and 1 ranks of expert group
    {0, 2, 4}, so its shards could not be equal."""
    from meshlm.parallel.dp.zero import nested_shard_lists

    with pytest.raises(ValueError) as e:
        nested_shard_lists([(0, 2, 4), (1, 3, 5)], [(0, 1, 2), (3, 4, 5)])
    assert str(e.value).startswith("parallel.zero_shard_size (3) cuts the ranks that hold the same experts")
    assert "\n" not in str(e.value)


def test_top_k_above_the_experts_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^model.top_k must be between 1 and model.n_experts \(4\), got 5$"):
        MOE_MODEL.replace(top_k=5)


def test_received_rows_are_put_in_expert_major_order() -> None:
    """Rows received from 2 ranks for 2 local experts: source 0 sent 1 row for expert 0 and 2 for expert 1,
    source 1 sent 3 and 0. Expert 0's rows (sources 0 then 1) come first, then expert 1's."""
    from meshlm.parallel.ep.experts import expert_major_order

    order = expert_major_order(torch.tensor([[1, 2], [3, 0]]), 6)
    assert order.tolist() == [0, 3, 4, 5, 1, 2]


# ---- training like one process -------------------------------------------------------------------------------------
@contextlib.contextmanager
def combined_in_expert_order() -> Iterator[list]:
    """The bug: the experts' outputs go back in the order the experts ran them (expert-major), not in the order
    the rows arrived (source-major), so tokens get other tokens' outputs."""
    from meshlm.parallel.ep.experts import ShardedExperts

    fired: list = []
    original = ShardedExperts.restore

    def unrestored(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        fired.append(1)
        return y

    ShardedExperts.restore = staticmethod(unrestored)
    try:
        yield fired
    finally:
        ShardedExperts.restore = staticmethod(original)


@contextlib.contextmanager
def expert_grads_over_all_replicas() -> Iterator[list]:
    """The bug: data parallel ignores the gradient group the experts' placements name ("expert_replicas") and
    buckets them with the whole weights, so their gradients are reduced over every data replica (dp × ep),
    summing different experts' gradients."""
    from meshlm.parallel.dp import data_parallel
    from meshlm.parallel.placement import REPLICAS

    fired: list = []
    original = data_parallel.by_grad_group

    def one_group(params: list, placements: object) -> dict:
        groups = original(params, placements)
        fired.append(len(groups) > 1)
        return {REPLICAS: [p for members in groups.values() for p in members]}

    data_parallel.by_grad_group = one_group
    try:
        yield fired
    finally:
        data_parallel.by_grad_group = original


@contextlib.contextmanager
def norm_counts_rank0_only() -> Iterator[list]:
    """The bug: one primary replica for every buffer (global rank 0, as before per-buffer groups), so the
    gradient norm misses the expert shards the other ep ranks hold."""
    from meshlm.parallel.dp.data_parallel import ReduceGroups

    fired: list = []
    original = ReduceGroups.primary

    def rank0(self: ReduceGroups) -> bool:
        fired.append(1)
        return dist.get_rank() == 0

    ReduceGroups.primary = property(rank0)
    try:
        yield fired
    finally:
        ReduceGroups.primary = original


RUNS2 = {  # name -> (layout, parallel, train_layout kwargs), on 2 ranks
    "ep2": ("ep=2", {}, {}),
    "ep2 zero1 accumulation": ("ep=2", {"zero": 1}, {"micro_batch": 2}),
    "ep2 zero2 sgd": ("ep=2", {"zero": 2}, {"optimizer": "sgd"}),
    "ep2 zero3": ("ep=2", {"zero": 3}, {}),
}
RUNS4 = {
    "dp2 ep2 zero1": ("dp=2,ep=2", {"zero": 1}, {}),
    "dp2 ep2 sgd": ("dp=2,ep=2", {}, {"optimizer": "sgd"}),
    "dp2 ep2 zero3": ("dp=2,ep=2", {"zero": 3}, {}),
    "dp2 ep2 zero3 sgd": ("dp=2,ep=2", {"zero": 3}, {"optimizer": "sgd"}),
    # the all-to-all among the ranks of one stage; each micro-batch's aux losses through the pipeline
    "pp2 ep2 zero1": ("pp=2,ep=2", {"zero": 1}, {"micro_batch": 2}),
    "pp2 ep2 sgd": ("pp=2,ep=2", {}, {"micro_batch": 2, "optimizer": "sgd"}),
    "pp2 ep2 zero3": ("pp=2,ep=2", {"zero": 3}, {"micro_batch": 2}),
    # each cp rank routes its shard of the sequences; the balancing statistics are summed over cp
    "ep2 cp2 zero1": ("ep=2,cp=2", {"zero": 1}, {}),
    "ep2 cp2 sgd": ("ep=2,cp=2", {}, {"optimizer": "sgd"}),
    "ep2 cp2 ulysses zero3": ("ep=2,cp=2", {"zero": 3, "cp_attention": "ulysses"}, {}),
    # hybrid sharding: dense weights sharded over the ep pair of a block, experts replicated over dp
    "dp2 ep2 hybrid zero1": ("dp=2,ep=2", {"zero": 1, "zero_shard_size": 2}, {}),
    "dp2 ep2 hybrid zero3 sgd": ("dp=2,ep=2", {"zero": 3, "zero_shard_size": 2}, {"optimizer": "sgd"}),
}

RUNS8 = {  # three-way compositions: ep with pp and tp (sequence parallel), ep with cp and tp under ZeRO-3
    "pp2 ep2 tp2 sp zero1": ("pp=2,ep=2,tp=2", {"zero": 1, "sequence_parallel": True}, {"micro_batch": 2}),
    "ep2 cp2 tp2 zero3": ("ep=2,cp=2,tp=2", {"zero": 3}, {}),
}


def meta_built(layout: str, zero: int) -> dict[str, torch.Tensor]:
    """The full weights of a meta-built MoE model right after set-up under `layout` (each rank fills only its
    experts, by their ep placement; under pp only those of its stage)."""
    torch.manual_seed(11)
    with torch.device("meta"):
        model = Transformer(MOE_MODEL)
    lay = parse_layout(layout, dist.get_world_size())
    mesh = build_mesh(lay, "cpu")
    return parallelize(model, mesh, {"zero": zero, "micro_batches": lay.pp}).full_state_dict()


def train_moe_runs(runs: dict[str, tuple[str, dict, dict]]) -> dict[str, dict]:
    """train_layout of the MoE test model for each named (layout, parallel, kwargs)."""
    return {name: train_layout(lay, par, **{"model_cfg": MOE_MODEL, **kw}) for name, (lay, par, kw) in runs.items()}


def assert_starts_like_one_process(got: dict[str, torch.Tensor]) -> None:
    """`got` (meta_built's full weights) equals one process's model drawn from the same seed, bit for bit."""
    torch.manual_seed(11)
    want = Transformer(MOE_MODEL).state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def world2_job(checkpoint_dir: str) -> dict:
    out = {"meta ep2 zero0": meta_built("ep=2", 0), "meta ep2 zero3": meta_built("ep=2", 3)}
    out |= {"saved": train_layout("ep=2", {"zero": 1}, model_cfg=MOE_MODEL, stop=SAVED_AT, save_to=checkpoint_dir)}
    out |= train_moe_runs(RUNS2)
    mutations = {
        "wrong order": combined_in_expert_order,
        "all replicas": expert_grads_over_all_replicas,
        "norm on rank 0": norm_counts_rank0_only,
    }
    for bug, mutation in mutations.items():
        with mutation() as fired:
            out[bug] = train_layout("ep=2", {}, model_cfg=MOE_MODEL)
        out[bug]["fired"] = sum(fired)
    return out


def world4_job(checkpoint_dir: str) -> dict:
    out = train_moe_runs(RUNS4)
    out["meta dp2 ep2 zero1"] = meta_built("dp=2,ep=2", 1)
    out["meta pp2 ep2 zero3"] = meta_built("pp=2,ep=2", 3)
    out["resumed ep4"] = train_layout("ep=4", {}, model_cfg=MOE_MODEL, start=SAVED_AT, resume_from=checkpoint_dir)
    out["resumed pp2 ep2"] = train_layout(
        "pp=2,ep=2", {"zero": 1}, model_cfg=MOE_MODEL, micro_batch=2, start=SAVED_AT, resume_from=checkpoint_dir
    )
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ep-checkpoint"))


@pytest.fixture(scope="module")
def world2(checkpoint_dir: str) -> dict:
    return run_shared(world2_job, 2, checkpoint_dir, timeout=600)[0]


@pytest.fixture(scope="module")
def world4(world2: dict, checkpoint_dir: str) -> dict:  # after world2: it resumes world2's checkpoint
    return run_shared(world4_job, 4, checkpoint_dir, timeout=900)[0]


def world8_job() -> dict:
    return train_moe_runs(RUNS8)


def _reference(kwargs: dict) -> dict:
    args = {"model_cfg": MOE_MODEL, **{k: v for k, v in kwargs.items() if k != "micro_batch"}}
    return reference(**args)


@pytest.mark.slow  # nine 10-step runs of a 4-expert model on two ranks: ~40 s on 2 cores
@pytest.mark.parametrize("name", list(RUNS2))
def test_ep2_trains_like_one_process(world2: dict, name: str) -> None:
    assert_close_runs(_reference(RUNS2[name][2]), world2[name])


@pytest.mark.slow  # twelve 10-step runs and two 5-step resumes on four ranks: ~2 min on 2 cores
@pytest.mark.parametrize("name", list(RUNS4))
def test_ep2_with_dp_pp_cp_and_hybrid_sharding_trains_like_one_process(world4: dict, name: str) -> None:
    assert_close_runs(_reference(RUNS4[name][2]), world4[name])


@pytest.mark.slow  # two 10-step runs on eight ranks
def test_ep2_in_three_way_compositions_trains_like_one_process() -> None:
    got = run_shared(world8_job, 8, timeout=900)[0]
    for name, (_, _, kwargs) in RUNS8.items():
        assert_close_runs(_reference(kwargs), got[name])


@pytest.mark.slow  # shares the fixtures above
@pytest.mark.parametrize("name", ["meta ep2 zero0", "meta ep2 zero3", "meta dp2 ep2 zero1", "meta pp2 ep2 zero3"])
def test_meta_built_model_starts_bit_identical_to_one_process(world2: dict, world4: dict, name: str) -> None:
    assert_starts_like_one_process({**world2, **world4}[name])


@pytest.mark.slow  # shares the world2 fixture
@pytest.mark.parametrize("bug", ["wrong order", "all replicas", "norm on rank 0"])
def test_ep_bugs_fail_the_loss_criterion(world2: dict, bug: str) -> None:
    """Tokens combined in the wrong order, expert gradients reduced over all data replicas, and a gradient
    norm that counts expert shards on one ep rank only change the loss curve or the norms (`fired` counts
    the calls of the bug on this rank)."""
    got = world2[bug]
    assert got["fired"]
    assert "losses" in criterion_failures(_reference({}), got)


@pytest.mark.slow  # shares the world2 fixture, plus a 5-step run in one process
def test_ep2_checkpoint_resumes_in_one_process(world2: dict, checkpoint_dir: str) -> None:
    """Saved at ep=2 ZeRO-1 (each rank's experts as boxes of the full stacked tensors), resumed at ep=1: the
    weights load bit for bit and the remaining steps continue the one-process curve."""
    resumed = train_layout("", model_cfg=MOE_MODEL, start=SAVED_AT, resume_from=checkpoint_dir)
    assert_identical_weights(world2["saved"]["state"], resumed["resumed_state"])
    assert_close_runs(tail(_reference({}), SAVED_AT), resumed)


@pytest.mark.slow  # shares the world4 fixture
@pytest.mark.parametrize("name", ["resumed ep4", "resumed pp2 ep2"])
def test_ep2_checkpoint_resumes_at_ep4_and_pp2_ep2(world2: dict, world4: dict, name: str) -> None:
    """At pp=2 × ep=2 each rank loads only its stage's share of its experts."""
    resumed = world4[name]
    assert_identical_weights(world2["saved"]["state"], resumed["resumed_state"])
    assert_close_runs(tail(_reference({}), SAVED_AT), resumed)
