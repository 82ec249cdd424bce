"""Data parallelism and ZeRO-1/2/3 (and hybrid sharding) train like one process on the same global batch and like
PyTorch's DDP and FSDP2, and do not communicate on the inner micro-batches of gradient accumulation.

Each world runs every configuration in sequence in one call (on the session's shared gloo group of that size);
the tests only compare results. As tests/equivalence.py says: AdamW runs are compared by their loss curves, and
each has an SGD twin whose final weights are compared too; a skipped bucket all-reduce and a shifted ZeRO shard
offset must fail every criterion.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from dp_helpers import build, dp_options
from equivalence import (
    TEST_MODEL,
    assert_close_runs,
    assert_mutations_caught,
    global_batch,
    reference,
    train_layout,
    train_mutated,
)
from torch.profiler import ProfilerActivity, profile

from meshlm.config import TrainSection
from meshlm.model import ModelConfig, Transformer, cross_entropy_loss
from meshlm.parallel.dp.data_parallel import DataParallel
from meshlm.parallel.dp.zero import FlatBuffer, FreedParameterError, resident
from meshlm.train.optim import lr_at

STEPS, BATCH, SEQ = 10, 8, 32
# ~52k fp32 elements: the test model's matrices fill four buckets and its norm weights a fifth, so every run
# crosses bucket boundaries inside and between blocks; 0.02 MB (23 buckets) tested nothing more at 2.5x the time.
SMALL_BUCKETS_MB = 0.2

# name -> (parallel section, DataParallel options, micro_batch: sequences per micro-batch, 0 = no accumulation);
# each replica gets BATCH / world sequences, so micro_batch 1 at world 4 and 2 at world 2 mean 2 micro-batches.
WORLD4_RUNS = {
    "zero0": ({"zero": 0}, {}, 0),
    "zero1": ({"zero": 1}, {}, 0),
    "zero2": ({"zero": 2}, {}, 0),
    "zero3": ({"zero": 3}, {}, 0),
    "zero0 accumulation": ({"zero": 0}, {}, 1),
    "zero1 accumulation": ({"zero": 1}, {}, 1),
    "zero2 accumulation": ({"zero": 2}, {}, 1),
    "zero3 checkpointing": ({"zero": 3}, {"activation_checkpointing": True}, 0),
    "zero3 accumulation checkpointing": ({"zero": 3}, {"activation_checkpointing": True}, 1),
    "hybrid zero1": ({"zero": 1, "zero_shard_size": 2}, {}, 0),
    "hybrid zero2 accumulation": ({"zero": 2, "zero_shard_size": 2}, {}, 1),
    "hybrid zero3 checkpointing": ({"zero": 3, "zero_shard_size": 2}, {"activation_checkpointing": True}, 0),
}
WORLD2_RUNS = {
    "zero0": ({"zero": 0}, {}, 0),
    "zero1": ({"zero": 1}, {}, 0),
    "zero2": ({"zero": 2}, {}, 0),
    "zero3": ({"zero": 3}, {}, 0),
    "zero3 accumulation": ({"zero": 3}, {}, 2),
    "zero1 one bucket per kind": ({"zero": 1, "bucket_mb": 25.0}, {}, 0),
}
BF16_RUNS = {f"zero{z} bf16": ({"zero": z, "zero_param_dtype": "bf16"}, {}, 0) for z in (1, 2, 3)}
TIED_MODEL = TEST_MODEL.replace(tie_embeddings=True)  # the head's weight lives in the embedding's ZeRO-3 unit


# (mutation, parallel section, optimizer): real bugs every criterion must catch.
MUTATIONS = [
    ("dp bucket not all-reduced", {"zero": 0, "bucket_mb": 25.0}, "adamw"),
    ("dp bucket not all-reduced", {"zero": 0, "bucket_mb": 25.0}, "sgd"),
    ("zero shard offset off by one", {"zero": 1}, "adamw"),
    ("zero shard offset off by one", {"zero": 3}, "sgd"),
]


def run_all(runs: dict, model_cfg: ModelConfig = TEST_MODEL, optimizers: tuple[str, ...] = ("adamw", "sgd")) -> dict:
    """Every run with each optimizer: results[name] is the AdamW run, results[name + " sgd"] its SGD twin."""
    results = {}
    for name, (parallel, options, micro_batch) in runs.items():
        parallel = {"bucket_mb": SMALL_BUCKETS_MB, **parallel}
        for optimizer in optimizers:
            with dp_options(**options):
                results[name if optimizer == "adamw" else f"{name} {optimizer}"] = train_layout(
                    "", parallel, batch=BATCH, micro_batch=micro_batch, seq_len=SEQ, model_cfg=model_cfg,
                    optimizer=optimizer,
                )  # fmt: skip
    return results


def native_run(kind: str) -> dict:
    """The same training with PyTorch's own DistributedDataParallel or per-block fully_shard (FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(TEST_MODEL)
    if kind == "ddp":
        net = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.model.layers.values():
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    train = TrainSection(steps=STEPS, global_batch=BATCH, lr=3e-3, eps=1e-6, warmup_steps=2, grad_clip=1.0)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, BATCH, SEQ, TEST_MODEL.vocab_size)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = cross_entropy_loss(net(x[rows]), y[rows])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
    state = {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()
        for name, t in model.state_dict().items()
    }
    return {"losses": losses, "grad_norms": norms, "state": state}


def collectives_per_micro_batch(zero: int) -> list[list[str]]:
    """The c10d collectives each of two micro-batches issues (inner: no grad sync; last: sync)."""
    pm, _, _ = build(TEST_MODEL, zero, SMALL_BUCKETS_MB, n_micro=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, BATCH, SEQ, TEST_MODEL.vocab_size)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    seen = []
    num_tokens = pm.count_tokens(y[rows])  # once per step, as forward_backward does: one all-reduce of a scalar
    for i, (xm, ym) in enumerate(zip(x[rows].chunk(2), y[rows].chunk(2), strict=True)):
        pm.set_grad_sync(0, i == 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pm.loss_fn(pm.chunks[0](xm), ym, num_tokens).backward()
        seen.append(sorted({e.name for e in prof.events() if e.name.startswith("c10d::")}))
    pm.dp.finish_grad_sync()
    return seen


def world4_job() -> dict:
    return run_all(WORLD4_RUNS)


def world2_job() -> dict:
    results = {**run_all(WORLD2_RUNS), **run_all(BF16_RUNS, optimizers=("adamw",))}
    tied = run_all({"tied": ({"zero": 3}, {"activation_checkpointing": True}, 2)}, TIED_MODEL)
    results.update(tied)
    results["ddp"] = native_run("ddp")
    results["fsdp2"] = native_run("fsdp2")
    results["collectives"] = {zero: collectives_per_micro_batch(zero) for zero in (0, 1, 2, 3)}
    results["mutated"] = [
        train_mutated(mutation, [("", parallel, {"optimizer": optimizer})])[0]
        for mutation, parallel, optimizer in MUTATIONS
    ]
    return results


@pytest.fixture(scope="module")
def world4() -> dict:
    return run_shared(world4_job, 4, timeout=300)[0]


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_shared(world2_job, 2, timeout=300)[0]


def assert_same_training(ref: dict, got: dict) -> None:
    """Loss curve and gradient norms (every run); final weights (SGD runs)."""
    assert_close_runs(ref, got)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("name", list(WORLD4_RUNS))
@pytest.mark.slow  # its module fixture trains 30 runs on four ranks: ~20 s
def test_world4_trains_like_one_process(world4: dict, name: str, optimizer: str) -> None:
    assert_same_training(reference(optimizer=optimizer), world4[name if optimizer == "adamw" else f"{name} sgd"])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("name", list(WORLD2_RUNS))
def test_world2_trains_like_one_process(world2: dict, name: str, optimizer: str) -> None:
    assert_same_training(reference(optimizer=optimizer), world2[name if optimizer == "adamw" else f"{name} sgd"])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_zero3_with_tied_embeddings(world2: dict, optimizer: str) -> None:
    """The embedding unit is gathered by the head too; with accumulation and activation checkpointing."""
    got = world2["tied" if optimizer == "adamw" else "tied sgd"]
    assert_same_training(reference(model_cfg=TIED_MODEL, optimizer=optimizer), got)


def test_zero0_trains_like_ddp(world2: dict) -> None:
    assert_same_training(world2["ddp"], world2["zero0"])


def test_zero3_trains_like_fsdp2(world2: dict) -> None:
    assert_same_training(world2["fsdp2"], world2["zero3"])


def test_real_bugs_fail_every_criterion(world2: dict) -> None:
    """A gradient bucket whose all-reduce is skipped (the norm weights' bucket: a small fraction of the model)
    and a reduce-scatter read one element off its shard offset: AdamW loss curves and SGD weights both fail."""
    refs = [reference(optimizer=optimizer) for _, _, optimizer in MUTATIONS]
    labels = [f"{mutation} {parallel} {optimizer}" for mutation, parallel, optimizer in MUTATIONS]
    assert_mutations_caught(refs, [world2["mutated"]], labels)


@pytest.mark.parametrize("name", list(BF16_RUNS))
def test_bf16_params_track_fp32_run(world2: dict, name: str) -> None:
    """bf16 working weights over fp32 masters: same trajectory up to bf16 rounding, and really bf16 (not equal)."""
    got, ref = world2[name], reference()
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-2)
    assert got["losses"] != pytest.approx(ref["losses"], rel=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_no_communication_on_inner_micro_batches(world2: dict, zero: int) -> None:
    inner, last = world2["collectives"][zero]
    assert not [name for name in inner if "reduce" in name]  # no gradient traffic at all
    if zero < 3:
        assert inner == []
    else:
        assert inner and all("gather" in name for name in inner)  # ZeRO-3 gathers its weights, nothing else
    assert [name for name in last if "reduce" in name]


def test_rejects_impossible_options() -> None:
    reference()  # the one-process gloo group the reference runs in
    chunks = [Transformer(TEST_MODEL)]
    with pytest.raises(ValueError, match="zero must be"):
        DataParallel(chunks, dist.group.WORLD, zero=4)
    with pytest.raises(ValueError, match="need zero >= 1"):
        DataParallel(chunks, dist.group.WORLD, zero=0, shard_group_size=1)
    with pytest.raises(ValueError, match="must divide"):
        DataParallel(chunks, dist.group.WORLD, zero=3, shard_group_size=3)


@pytest.mark.parametrize("piece", [None, 2**30])
def test_norm_of_a_long_flat_buffer_is_as_exact_as_per_tensor_norms(monkeypatch: pytest.MonkeyPatch, piece) -> None:
    """ZeRO-0 flat gradient buffers are long: the CPU's fp32 running sum of 262144 squares is off by ~1e-5
    relative (more than the equivalence tests' 1e-5 on the gradient norm), so squared_norm_sum cuts them into
    pieces (~1e-8). The mutation (piece = 2**30: one running sum per buffer) must fail the 1e-6 bound."""
    from meshlm.parallel.dp import gradients

    if piece is not None:
        monkeypatch.setattr(gradients, "CPU_NORM_PIECE", piece)
    torch.manual_seed(0)
    flat = torch.randn(2**18) * torch.rand(2**18)  # uneven magnitudes, as gradients have
    exact = flat.double().square().sum()
    got = gradients.squared_norm_sum([flat], torch.device("cpu"))
    error = abs(got.item() - exact.item()) / exact.item()
    # 1e-6: 25× the pieces' measured error (~4e-8), 6× below the unpieced one's (6e-6 to 1e-5)
    assert (error <= 1e-6) == (piece is None), error


def test_freed_zero3_weights_raise_when_read_and_return_on_gather() -> None:
    """In one process: while a ZeRO-3 buffer's gathered weights are freed its parameters are the same objects
    with the same shapes, dtypes and autograd edges, but reading their values raises FreedParameterError
    (reading the freed storage could crash the process: SIGSEGV); a gather makes them plain parameters holding
    the gathered values again, and a backward whose forward ran before the free computes with them. Mutation:
    without free_params's FreedParameter the `resident` assert fails, before any read of freed memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    twin = copy.deepcopy(model)
    params = list(model.parameters())
    buf = FlatBuffer(params, shard_size=1, shard_rank=0, dtype=torch.float32)
    gathered = buf.data.clone()
    x = torch.randn(3, 6)
    out = model(x)

    buf.free_params()
    assert buf.data.untyped_storage().nbytes() == 0
    # No assert may show a parameter: pytest would print it, reading freed memory if the guard failed.
    assert not any(resident(p) for p in params)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    for p, q in zip(params, twin.parameters(), strict=True):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert (p.shape, p.dtype, p.device, p.numel(), p.grad) == (q.shape, q.dtype, q.device, q.numel(), None)
        for read in (torch.Tensor.sum, torch.Tensor.norm, torch.Tensor.clone, repr, lambda t: t.data):
            with pytest.raises(FreedParameterError, match=r"was read .*model\.full_state_dict\(\)"):
                read(p)
    with pytest.raises(FreedParameterError):
        model(x)
    with pytest.raises(FreedParameterError):
        model.state_dict()

    buf.alloc_params()  # what a gather does before the all-gather fills the storage
    buf.data.copy_(gathered)
    assert all(type(p) is torch.nn.Parameter for p in params)
    out.sum().backward()
    twin(x).sum().backward()
    for p, q in zip(params, twin.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
