"""Gradient accumulation in fp32 under bf16 ZeRO working weights (parallel.grad_accum_dtype, issue #51 item 2).

On CUDA ZeRO's working weights are bf16 (parallel.zero_param_dtype 'auto'); here they are forced to bf16 on
the CPU by the same option set explicitly. Each rank runs M = 4 micro-batches; the final gradient, after the
reduction over dp = 2 ranks, is read back through an optimizer that copies each gradient into its fp32 master
(meshlm.check.worker.CopyGradient), gathered by `full_state_dict`, under ZeRO-1, 2, 3 and hybrid sharding
(shard 1 × replicate 2; in the slow tier ZeRO-3 shard 2 × replicate 2 on four ranks).

The reference: the same bf16 model as a plain module, each micro-batch's gradient computed through the
engine's own loss (`ParallelModel.loss_fn` with the step's token count, so the scale is the run's) — the
very bf16 tensors autograd gives the run, bit for bit (same weights, rows, kernels) — summed in float64
over the micro-batches and the ranks, divided by dp.

The bound, per element: u·|ref| + (M + dp)·2⁻²⁴·Σ|g|/dp, with u = 2⁻⁸ bf16's unit roundoff. The first term
is one bf16 rounding of the final gradient: what a gradient held in bf16 costs at the least, so fp32
accumulation must beat it. The second is the fp32 summation bound (γₙ·Σ|terms|, n - 1 additions of M
micro-batches on a rank and dp ranks in the reduction), which covers fp32 accumulation's only error and
makes an element whose terms nearly cancel no false alarm. fp32 accumulation lands ~2¹⁶ inside the bound.
A bf16 buffer rounds the running sum at every micro-batch after the first (M - 1 roundings of partial sums
that are larger than the final value where micro-batches cancel): `grad_accum_dtype = 'bf16'` must
break the bound, which proves it sharp, and it does (at 48544 of 213568 elements on two ranks; the float32
runs' worst element is 2e-5 of its bound).

Mutation (done by hand): with DataParallel's gradient buffers back in the working dtype (`self.grad_dtype =
param_dtype` after `widened`: param.grad views of a bf16 buffer, the code before this test), every float32
case below fails like the bfloat16 ones, and so does the planner's zero-1 count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import TEST_MODEL, global_batch, reference

from meshlm.check.worker import CopyGradient
from meshlm.errors import InputError
from meshlm.model import Transformer
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.dp.data_parallel import DataParallel
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.strategies import check_layout
from meshlm.plan.memory import model_state_bytes

MICRO, SEQ = 4, 32  # micro-batches per rank (one row each), tokens per row
BF16_U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest
FP32_U = 2.0**-24
CASES = {
    "zero1": {"zero": 1},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "hsdp zero2": {"zero": 2, "zero_shard_size": 1},  # shard within 1 rank, replicate across the 2
}
WORLD4_CASES = {"hsdp zero3 2x2": {"zero": 3, "zero_shard_size": 2}}  # shard over 2 ranks, replicate over 2
ACCUM = ("fp32", "bf16")


def reference_grads(x: torch.Tensor, y: torch.Tensor, pm: object) -> tuple[dict, dict]:
    """(Σ g, Σ |g|) in float64 over this rank's micro-batches, g each one's bf16 gradient of the engine's loss."""
    torch.manual_seed(0)
    model = Transformer(TEST_MODEL)
    for p in model.parameters():  # the working weights are bf16, the buffers (RoPE tables) stay as they are
        p.data = p.data.to(torch.bfloat16)
    total, magnitude = {}, {}
    num_tokens = torch.tensor(float(y.numel() * dist.get_world_size()))
    for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
        model.zero_grad(set_to_none=True)
        pm.loss_fn(model(xm), ym, num_tokens).backward()
        for name, p in model.named_parameters():
            g = p.grad.double()
            total[name] = total.get(name, 0) + g
            magnitude[name] = magnitude.get(name, 0) + g.abs()
    return total, magnitude


def accumulated(options: dict, accum: str) -> dict:
    """Violations of the bound by the run's reduced gradient after MICRO micro-batches, over every tensor."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(parse_layout("", world), "cpu")
    torch.manual_seed(0)
    parallel = {**options, "zero_param_dtype": "bf16", "grad_accum_dtype": accum, "micro_batches": MICRO}
    pm = parallelize(Transformer(TEST_MODEL), mesh, parallel)
    x, y = global_batch(0, MICRO * world, SEQ, TEST_MODEL.vocab_size)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    pm.forward_backward(x[rows], y[rows])
    pm.step(CopyGradient(pm.optimizer_param_groups(0.0)))
    got = pm.full_state_dict()
    total, magnitude = reference_grads(x[rows], y[rows], pm)
    violations = elements = 0
    worst = 0.0
    for name in sorted(total):
        ref, size = total[name], magnitude[name]
        dist.all_reduce(ref)
        dist.all_reduce(size)
        ref, size = ref / world, size / world
        bound = BF16_U * ref.abs() + (MICRO + world) * FP32_U * size
        error = (got[name].double() - ref).abs()
        violations += int((error > bound).sum())
        elements += ref.numel()
        worst = max(worst, float((error / bound.clamp(min=1e-300)).max()))
    return {"violations": violations, "elements": elements, "worst": worst}


def job(cases: dict) -> dict:
    return {(name, accum): accumulated(options, accum) for name, options in cases.items() for accum in ACCUM}


@pytest.fixture(scope="module")
def runs() -> dict:
    # 8 runs of 4 micro-batches on two ranks, each with its reference: 2.7 CPU-seconds a rank (11 s at load 20)
    return run_shared(job, 2, CASES, timeout=300)[0]


@pytest.fixture(scope="module")
def runs4() -> dict:
    return run_shared(job, 4, WORLD4_CASES, timeout=300)[0]


def check_accumulation(got: dict, accum: str) -> None:
    if accum == "fp32":
        assert got["violations"] == 0, got
        assert got["worst"] < 0.01, got  # the fp32 sum is ~2¹⁶ inside: no element comes near the bound
    else:  # the float32 check is sharp: the bf16 buffer's drift (the code before issue #51) fails it
        assert got["violations"] > 0.001 * got["elements"], got


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("name", list(CASES))
def test_fp32_accumulation_is_within_one_bf16_rounding_of_the_final_gradient(runs: dict, name: str, accum: str) -> None:
    """float32: within the bound; bfloat16 (proving the bound sharp): outside it at > 0.1% of the elements."""
    check_accumulation(runs[(name, accum)], accum)


@pytest.mark.slow  # four ranks, two runs: ~10 s on 2 cores
@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("name", list(WORLD4_CASES))
def test_hybrid_sharding_over_four_ranks(runs4: dict, name: str, accum: str) -> None:
    check_accumulation(runs4[(name, accum)], accum)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"zero": 0}, "parallel.zero = 0"),
        ({"zero": 2, "zero_param_dtype": "fp32"}, "parallel.zero_param_dtype = 'fp32'"),
    ],
)
def test_bf16_accumulation_over_fp32_weights_is_refused_by_the_layout_check(options: dict, why: str) -> None:
    spec = LayoutSpec(TEST_MODEL, parse_layout("", 2), 8, options=ParallelOptions(**options, grad_accum_dtype="bf16"))
    with pytest.raises(InputError, match=r"^parallel.grad_accum_dtype = 'bf16' needs bf16 working weights") as e:
        check_layout(spec)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_bf16_accumulation_over_auto_weights_off_cuda_is_refused_at_build() -> None:
    """'auto' working weights are fp32 on the CPU: known only with the device, when the strategy applies."""
    reference()  # the one-process gloo group the reference runs in
    mesh = build_mesh(parse_layout("", 1), "cpu")
    options = {"zero": 1, "grad_accum_dtype": "bf16", "autocast_dtype": "bf16"}
    with pytest.raises(InputError, match=r"parallel\.zero_param_dtype = 'auto'"):
        parallelize(Transformer(TEST_MODEL), mesh, options)
    with pytest.raises(ValueError, match="needs working weights of that dtype"):  # the library's own guard
        DataParallel([Transformer(TEST_MODEL)], dist.group.WORLD, zero=1, grad_accum_dtype=torch.bfloat16)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("accum", ACCUM)
def test_planner_counts_the_gradient_buffer_in_its_dtype(zero: int, accum: str) -> None:
    """The runtime's gradient bytes after a step's backward (two micro-batches) are the planner's, within the
    5% of tests/parallel/test_zero_bytes.py (flat-buffer padding). ZeRO-1's full buffer is fp32 (4 bytes per
    parameter, the reduced shard a view of it) or bf16 beside an fp32 shard (2 + 4/dp); ZeRO-2/3 hold the
    reduced fp32 shard (4/dp). Mutation: the planner's bf16 count for float32 (2 + 4/dp) fails zero 1."""
    reference()
    mesh = build_mesh(parse_layout("", 1), "cpu")
    torch.manual_seed(0)
    options = {"zero": zero, "zero_param_dtype": "bf16", "grad_accum_dtype": accum, "micro_batches": 2}
    pm = parallelize(Transformer(TEST_MODEL), mesh, options)
    x, y = global_batch(0, 2, SEQ, TEST_MODEL.vocab_size)
    pm.forward_backward(x, y)
    held = pm.dp.memory_report()["grads"]
    psi = sum(p.numel() for p in Transformer(TEST_MODEL).parameters())
    _, grads, _ = model_state_bytes(psi, 1, zero, "bf16", grad_accum_dtype=accum)
    assert abs(held - grads) <= 0.05 * grads, (held, grads)


def test_planner_bytes_per_parameter_by_accumulation_dtype() -> None:
    """ZeRO-1 in bf16 at dp 8: an fp32 gradient buffer is 4 bytes per parameter, its reduced shard a view of
    it; a bf16 one 2, beside the fp32 shard (0.5); ZeRO-2 keeps only the shard either way."""
    psi = 1e9
    assert model_state_bytes(psi, 8, 1, "bf16")[1] == 4.0 * psi
    assert model_state_bytes(psi, 8, 1, "bf16", grad_accum_dtype="bf16")[1] == 2.5 * psi
    assert model_state_bytes(psi, 8, 2, "bf16", grad_accum_dtype="bf16")[1] == 0.5 * psi
