"""The planner's bytes per parameter are the runtime's: for world 1, 2 and 4, ZeRO 0-3, fp32 and bf16 working
weights (and both gradient-reduction dtypes), the parameter, gradient and optimizer bytes a rank really holds
at its peak within a step (after backward, before the update: full gradients still there under ZeRO 0/1, Adam's
moments allocated) are within 5% of meshlm.plan.memory.model_state_bytes.

5%: the runtime pads each flat buffer to a multiple of the shard group (Ψp ≥ Ψ) and the planner does not;
for this model the padding is < 0.1% of Ψ, so any wrong term (a missing fp32 shard is 4/S bytes of 10-20)
is ≥ 10% off and fails. The mutation test below shows it does.

A small mixture-of-experts model does the same at ep=1 (dp=2) and ep=2 (world 2): the planner's dense and
expert parameters (meshlm.plan.memory.moe_stage_params), each reduced and ZeRO-sharded over its own group
(moe_state_bytes: dense over dp × ep × cp, experts over dp × cp), against what the runtime's flat buffers hold.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import global_batch

from meshlm.config import TrainSection
from meshlm.model import ModelConfig, Transformer
from meshlm.parallel.dp.gradients import unique_storage_bytes
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan.memory import Candidate, model_state_bytes, moe_stage_params, moe_state_bytes
from meshlm.train.optim import build_optimizer, train_step

MODEL = ModelConfig(vocab_size=256, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96, max_seq_len=32)
TOLERANCE = 0.05
# (zero, zero_param_dtype, zero_reduce_dtype); the planner's precision is the working dtype. Zero 0 'auto' is
# how a bf16-autocast GPU run holds zero 0 (fp32 weights; the planner's `bf16` precision).
CASES = [(0, "fp32", "fp32"), (0, "fp32", "bf16"), (0, "auto", "fp32")] + [
    (zero, dtype, reduce) for zero in (1, 2, 3) for dtype in ("fp32", "bf16") for reduce in ("fp32", "bf16")
]


def held_bytes(pm: ParallelModel, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters (working weights and fp32 masters), gradients and optimizer state this rank holds."""
    if pm.dp is not None:
        return pm.dp.memory_report(opt)
    params = [p for _, p in pm.named_parameters()]
    state = [v for p in params for k, v in opt.state[p].items() if k != "step"]
    return {
        "params": unique_storage_bytes(params),
        "grads": unique_storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": unique_storage_bytes(state),
    }


def measure(
    zero: int, param_dtype: str, reduce_dtype: str, model: ModelConfig = MODEL, layout: str = ""
) -> dict[str, int]:
    world = dist.get_world_size()
    mesh = build_mesh(parse_layout(layout, world), "cpu")
    rank, replicas = mesh.rank("batch"), mesh.size("batch")  # dp × ep ranks get rows of their own
    parallel = ParallelOptions(zero=zero, zero_param_dtype=param_dtype, zero_reduce_dtype=reduce_dtype)
    torch.manual_seed(0)
    pm = parallelize(Transformer(model), mesh, parallel)
    train = TrainSection(steps=4, global_batch=4, warmup_steps=0)
    opt = build_optimizer(pm, train)
    x, y = global_batch(0, 4, 16, model.vocab_size)
    rows = slice(rank * 4 // replicas, (rank + 1) * 4 // replicas)
    train_step(pm, opt, x[rows], y[rows], 1e-3, 1.0)  # Adam's moments exist from here on
    pm.forward_backward(x[rows], y[rows])
    pm.clip_grad_norm_(1.0)
    held = held_bytes(pm, opt)
    pm.zero_grad()
    return held


def job() -> dict:
    return {case: measure(*case) for case in CASES}


# worlds 2 and 4: 10-30 s on 2 cores, slow tier; world 1 (every stage and dtype) stays in the fast one
@pytest.fixture(
    scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def measured(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_shared(job, request.param, timeout=300)


StateBytes = Callable[[float, int, int, str], tuple[float, float, float]]


def predicted(world: int, zero: int, param_dtype: str, state_bytes: StateBytes) -> dict[str, float]:
    psi = sum(p.numel() for p in Transformer(MODEL).parameters())
    params, grads, optimizer = state_bytes(psi, world, zero, "fp32" if param_dtype == "fp32" else "bf16")
    return {"params": params, "grads": grads, "optimizer": optimizer}


def mismatches(world: int, ranks: list[dict], state_bytes: StateBytes = model_state_bytes) -> list[str]:
    out = []
    for case in CASES:
        expected = predicted(world, case[0], case[1], state_bytes)
        for rank, held in enumerate(ranks):
            for part, nbytes in held[case].items():
                if abs(nbytes - expected[part]) > TOLERANCE * expected[part]:
                    out.append(f"world {world} {case} rank {rank} {part}: runtime {nbytes}, planner {expected[part]}")
    return out


def test_planner_bytes_per_parameter_match_the_runtime(measured: tuple[int, list[dict]]) -> None:
    world, ranks = measured
    assert mismatches(world, ranks) == []


def test_the_zero_papers_counts_would_be_caught(measured: tuple[int, list[dict]]) -> None:
    """Mutation: the ZeRO paper's counts (what the planner used: no fp32 gradient shard, bf16 weights at
    zero 0) in place of meshlm's fail the comparison above for zero 0 and for ZeRO-1/2 in bf16."""
    world, ranks = measured
    wrong = mismatches(world, ranks, lambda *args: model_state_bytes(*args, runtime="megatron"))
    assert any("(0, 'auto'" in line for line in wrong)
    assert any("(1, 'bf16'" in line for line in wrong) and any("(2, 'bf16'" in line for line in wrong)


# Every layer MoE, 4 experts of width 96: the routed experts are ~70% of Ψ, so experts sharded over the wrong
# group (or not divided by ep) move every part by far more than the 5% tolerance.
MOE = MODEL.replace(
    hf_model_type="qwen2_moe", qkv_bias=True, n_experts=4, top_k=2, moe_intermediate_size=96,
    shared_expert_intermediate_size=48, shared_expert_gate=True,
)  # fmt: skip
MOE_CASES = [(0, "fp32", "fp32"), (0, "auto", "fp32")] + [(z, d, "fp32") for z in (1, 2, 3) for d in ("fp32", "bf16")]
MOE_LAYOUTS = ("dp=2", "ep=2")


def moe_job() -> dict:
    return {(layout, case): measure(*case, model=MOE, layout=layout) for layout in MOE_LAYOUTS for case in MOE_CASES}


@pytest.fixture(scope="module")
def moe_measured() -> list[dict]:
    return run_shared(moe_job, 2, timeout=300)


MoeBytes = Callable[[float, float, Candidate, str], tuple[float, float, float]]


def moe_mismatches(ranks: list[dict], state_bytes: MoeBytes = moe_state_bytes) -> list[str]:
    out = []
    for layout in MOE_LAYOUTS:
        mesh = parse_layout(layout, 2)
        dense, experts = moe_stage_params(MOE, 1, mesh.ep, MOE.n_layers, len(MOE.moe_layers), True, True)
        for case in MOE_CASES:
            zero, dtype, _ = case
            parts = state_bytes(
                dense, experts, Candidate(mesh, ParallelOptions(zero=zero)), "fp32" if dtype == "fp32" else "bf16"
            )
            expected = dict(zip(("params", "grads", "optimizer"), parts, strict=True))
            for rank, held in enumerate(ranks):
                for part, nbytes in held[layout, case].items():
                    if abs(nbytes - expected[part]) > TOLERANCE * expected[part]:
                        out.append(f"{layout} {case} rank {rank} {part}: runtime {nbytes}, planner {expected[part]}")
    return out


@pytest.mark.slow  # two spawned ranks, 16 model builds and steps: ~15 s on 2 cores
def test_planner_moe_bytes_match_the_runtime(moe_measured: list[dict]) -> None:
    assert moe_mismatches(moe_measured) == []


@pytest.mark.slow  # shares the fixture above
def test_experts_sharded_like_dense_weights_would_be_caught(moe_measured: list[dict]) -> None:
    """Mutation: expert states reduced and sharded over all data replicas (dp × ep × cp) like the dense ones,
    as a planner unaware of the expert-data group would count them, fail at ep=2 from ZeRO-1 on (at ZeRO-0
    nothing is sharded); at dp=2 the two groups are the same ranks and nothing changes."""

    def one_group(dense: float, experts: float, s: Candidate, precision: str) -> tuple[float, float, float]:
        return model_state_bytes(dense + experts, s.replicas, s.zero, precision)

    wrong = moe_mismatches(moe_measured, one_group)
    assert wrong and all(line.startswith("ep=2") for line in wrong)
    assert {line.split(")")[0].split("(")[1][0] for line in wrong} == {"1", "2", "3"}
