"""Train a tiny model under any layout and compare it with the same training in one process.

Same seed, same global batches, same optimizer: only the layout differs, so two correct runs differ only
by float32 rounding in a different order (other reduction trees, other kernels: AVX-512, AVX2 or plain
code, one thread or two). Each criterion below bounds what that rounding can do, so it holds on any CPU,
and `tests/test_*` prove each one sharp with a mutation (a real bug injected: a missing all-reduce, a
shifted shard offset, a KV head summed on one rank only, Adam moments lost on resume) that must fail it.

1. Loss curve, any optimizer: every step's loss within LOSS_RTOL = 1e-5 relative, and the gradient norm
   too. A loss is a mean over all tokens of the global batch; reduction order changes it by ~1e-7
   relative (measured: 1.6e-7 to 3.2e-7 under every kernel and layout), and the trajectories only
   diverge through the weights, which 10 steps of training keep within the same order. A real bug
   changes a gradient by O(1) relative and the next step's loss by far more than 1e-5.

2. Final weights, SGD runs (`optimizer="sgd"`): every tensor within
       WEIGHT_RTOL · (how far the reference moved it) + updates · ulp(its largest weight).
   SGD's update -lr·g is linear in the gradient and not normalised by it, so a relative rounding error
   of the gradients (the same ~1e-7 as the losses, bounded here by WEIGHT_RTOL = 1e-5 like them) gives
   at most that relative error of the distance the weights travel, and each update rounds the new
   weight once (half an ulp per run, an ulp between two runs). Measured: every difference is within
   one ulp (≤ 1.2e-7 on the norm weights at 1.0, ≤ 2e-8 on the matrices), 10× inside the bound, under
   AVX-512, AVX2 and default kernels with 1 or 2 threads; the bound for a projection matrix is ~4e-7,
   25× tighter than the 1e-5 absolute tolerance it replaces.

   AdamW's final weights are not compared. Adam divides each element's step by that element's own
   gradient scale (m̂/√v̂), so an element whose gradient is a near-cancelling sum (an embedding row seen a
   few times) gets its *relative* rounding error, not its absolute one, turned into an lr-sized step:
   measured 1.2e-5 on model.embed_tokens.weight under AVX-512, 7e-6 under default kernels, at elements
   whose √v̂ is typical. No bound from rounding alone is both portable and sharp there (the only safe
   one, 2·Σ lr_t, is vacuous), so AdamW runs are checked by criterion 1 — which still covers Adam's
   sharded state: ZeRO moments in the wrong place or lost on resume change the loss curve — and every
   layout's weights are checked by an SGD twin of its AdamW run.

3. Checkpoint round trip: the weights a resumed run starts from equal, bit for bit, those the saving run
   ended with, under any other layout and world size: loading reshards bytes and does no arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshlm.checkpoint import (
    CheckpointIO,
    init_optimizer_state,
    latest_valid_checkpoint,
    set_optimizer_steps,
    training_entries,
)
from meshlm.config import ParallelSection, TrainSection, load_config, parse_overrides
from meshlm.model import ModelConfig, Transformer, preset
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import LoRAOptions, Loss
from meshlm.parallel.strategies import check_layout
from meshlm.testing import global_batch, mask_prompts, rank_threads
from meshlm.train.optim import build_optimizer, lr_at, train_step
from meshlm.train.trainer import train

TEST_MODEL = preset("test")
LOSS_RTOL = 1e-5  # criterion 1
WEIGHT_RTOL = 1e-5  # criterion 2
ADAMW_LR = 3e-3
ADAMW_STEPS = 10  # criterion 1 holds over at least ten steps
# Criterion 2 after 4 updates (2 of warm-up, 2 at the peak): the same gradients, updates, post-update gathers
# and accumulation as after ten, at 40% of the cost (collectives dominate: ~4 ms each at 4 ranks on 2 cores).
SGD_STEPS = 4
SGD_LR = 0.2  # stable for every test model (see criterion 2); the loss falls ~0.15-0.2 in 10 steps


def train_layout(
    layout: str = "",
    parallel: dict | None = None,
    steps: int | None = None,
    batch: int = 8,
    micro_batch: int = 0,
    seq_len: int = 32,
    model_cfg: ModelConfig = TEST_MODEL,
    seed: int = 0,
    grad_clip: float = 1.0,
    start: int = 0,
    stop: int | None = None,
    resume_from: str | None = None,
    save_to: str | None = None,
    optimizer: str = "adamw",
    masked: float = 0.0,
    fused_loss: bool = False,
    lora_rank: int = 0,
) -> dict:
    """Run optimizer steps `start`..`stop - 1` of a `steps`-step schedule (all of them by default) with
    AdamW (meshlm's; ADAMW_STEPS by default) or plain SGD (SGD_STEPS by default); return {'losses',
    'grad_norms', 'state' (full fp32 weights), 'optimizer', 'updates' (optimizer steps since the initial
    weights), 'moved' (per tensor, the largest |final - initial| weight)}.

    `resume_from` loads the newest checkpoint of that run directory first (written under any layout) and
    adds 'resumed_state', the full weights right after loading; `save_to` saves a sharded checkpoint of
    step `stop` there at the end. `masked` > 0 labels about that fraction of the targets -100, unevenly per row
    (meshlm.testing.mask_prompts), as fine-tuning data does; `fused_loss` computes the loss with the head;
    `lora_rank` > 0 trains LoRA adapters of that rank on the frozen base (the Adapt transform, the adapters drawn
    from `seed` + 1)."""
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    if steps is None:
        steps = SGD_STEPS if optimizer == "sgd" else ADAMW_STEPS
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    par = ParallelSection(layout=layout, **(parallel or {}))
    # eps=1e-6 rather than 1e-8: Adam's step on an element with a gradient near eps is most sensitive there.
    train = TrainSection(
        steps=steps,
        global_batch=batch,
        micro_batch=micro_batch,
        lr=SGD_LR if optimizer == "sgd" else ADAMW_LR,
        eps=1e-6,
        warmup_steps=2,
        grad_clip=grad_clip,
        seed=seed,
    )
    lay = parse_layout(layout, world)
    n_micro = check_layout(LayoutSpec(model_cfg, lay, batch, micro_batch, seq_len, par.options()))
    mesh = build_mesh(lay, "cpu")
    torch.manual_seed(seed)
    model = Transformer(model_cfg)
    initial = {name: t.detach().clone() for name, t in model.state_dict().items()}
    options = {**par.options().model_dump(), "micro_batches": n_micro}
    lora = LoRAOptions(rank=lora_rank, alpha=8.0)
    pm = parallelize(model, mesh, options, loss=Loss(fused=fused_loss), lora=lora, lora_seed=seed + 1)
    tagged = [(name, key) for name, p in pm.named_parameters() for key in vars(p) if "meshlm" in key]
    assert not tagged, tagged  # placement lives in pm.placements (meshlm.parallel.placement), not on tensors
    if optimizer == "sgd":
        opt = torch.optim.SGD(pm.optimizer_param_groups(train.weight_decay), lr=train.lr, foreach=True)
    else:
        opt = build_optimizer(pm, train)
    out: dict = {}
    if resume_from or save_to:
        checkpointer = CheckpointIO(resume_from or save_to, keep=2, async_save=False, timeout_s=60)
    if resume_from:
        init_optimizer_state(opt)
        checkpointer.load(latest_valid_checkpoint(resume_from), training_entries(pm, opt))
        set_optimizer_steps(opt, start)
        pm.after_load()
        out["resumed_state"] = pm.full_state_dict()
    dp_rank, dp = mesh.rank("batch"), mesh.size("batch")  # dp × ep ranks get rows of their own
    losses, norms = [], []
    stop = steps if stop is None else stop
    for step in range(start, stop):
        x, y = global_batch(step, batch, seq_len, model_cfg.vocab_size, seed)
        if masked:
            y = mask_prompts(y, step, masked, seed)
        rows = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
        loss, norm, _ = train_step(pm, opt, x[rows], y[rows], lr_at(step, train), train.grad_clip)
        losses.append(loss)
        norms.append(norm)
    if save_to:
        checkpointer.save(stop, training_entries(pm, opt, writer=True), {"step": stop})
    state = pm.full_state_dict()
    moved = {name: (t - initial[name]).abs().max().item() for name, t in state.items() if name in initial}
    out.update(losses=losses, grad_norms=norms, state=state, optimizer=optimizer, updates=stop, moved=moved)
    return out


@functools.cache
def _reference(key: tuple) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())  # 1 by default: tiny matmuls, extra threads only contend with the ranks
    try:
        return train_layout("", **dict(key))
    finally:
        torch.set_num_threads(threads)


def reference(**kwargs: object) -> dict:
    """The single-process run of these train_layout arguments, computed once per test session (several
    modules compare against the same ones). Read it, do not modify it."""
    return _reference(tuple(sorted(kwargs.items())))


def tail(run: dict, start: int) -> dict:
    """`run` seen from step `start` on: the curve a run resumed at `start` must continue."""
    return {**run, "losses": run["losses"][start:], "grad_norms": run["grad_norms"][start:]}


# ---- the criteria ------------------------------------------------------------------------------------
def trainer_runs(runs: list[list[str]]) -> list[dict]:
    """`meshlm train` once per list of overrides, in turn on these ranks: losses, eval losses, start step."""
    out = []
    for overrides in runs:
        result = train(load_config(None, parse_overrides(overrides)))
        out.append({"losses": result.losses, "eval": result.eval_losses, "start": result.start_step})
    return out


def assert_same_losses(ref: dict, got: dict, rtol: float = LOSS_RTOL) -> None:
    """Criterion 1: per-step losses, and gradient norms where both runs report them, within rtol."""
    assert len(ref["losses"]) == len(got["losses"]), (len(ref["losses"]), len(got["losses"]))
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(a), f"step {step}: loss {b} vs reference {a}"
    if "grad_norms" in ref and "grad_norms" in got:
        for step, (a, b) in enumerate(zip(ref["grad_norms"], got["grad_norms"], strict=True)):
            assert abs(a - b) <= rtol * abs(a), f"step {step}: grad norm {b} vs reference {a}"


def _ulp(x: float) -> float:
    """The spacing of float32 numbers at |x|."""
    return torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(torch.tensor(abs(x)))).item()


def weight_tolerance(ref: dict, name: str) -> float:
    """Criterion 2's bound for tensor `name` of an SGD run (see the module docstring)."""
    largest = ref["state"][name].abs().max().item()
    return WEIGHT_RTOL * ref["moved"][name] + ref["updates"] * _ulp(largest or 1.0)


def assert_same_weights(ref: dict, got: dict) -> None:
    """Criterion 2: every final weight of two SGD runs within `weight_tolerance`."""
    if not (ref.get("optimizer") == got.get("optimizer") == "sgd"):
        raise ValueError("final weights are compared for SGD runs only (tests/equivalence.py, criterion 2)")
    assert ref["updates"] == got["updates"], (ref["updates"], got["updates"])
    assert ref["state"].keys() == got["state"].keys(), set(ref["state"]) ^ set(got["state"])
    for name, ref_tensor in ref["state"].items():
        diff = (ref_tensor - got["state"][name]).abs().max().item()
        tol = weight_tolerance(ref, name)
        assert diff <= tol, f"{name}: max |Δ| = {diff:.3g} > {tol:.3g}"


def assert_close_runs(ref: dict, got: dict, rtol: float = LOSS_RTOL) -> None:
    """Criterion 1, and criterion 2 when both are SGD runs. Runs without an 'optimizer' entry (a loop of
    one's own) count as adaptive: their weights are not compared."""
    if "optimizer" in ref and "optimizer" in got:
        assert ref["optimizer"] == got["optimizer"], (ref["optimizer"], got["optimizer"])
    assert_same_losses(ref, got, rtol)
    if ref.get("optimizer") == got.get("optimizer") == "sgd":
        assert_same_weights(ref, got)


def assert_identical_weights(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Criterion 3: bit for bit."""
    assert want.keys() == got.keys(), set(want) ^ set(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), f"{name}: max |Δ| = {(tensor - got[name]).abs().max().item()}"


def criterion_failures(ref: dict, got: dict) -> dict[str, str]:
    """What each applicable criterion says about `got` (a mutated run): {criterion: failure message}."""
    checks = {"losses": assert_same_losses}
    if ref.get("optimizer") == got.get("optimizer") == "sgd":
        checks["weights"] = assert_same_weights
    failures = {}
    for name, check in checks.items():
        try:
            check(ref, got)
        except AssertionError as e:
            failures[name] = str(e).splitlines()[0]
    return failures


# ---- mutations: real bugs, injected on the ranks, that the criteria must catch ---------------------------
# Each is a context manager run on every rank around train_layout; it yields a list whose length counts how
# often the bug fired, so a test can tell "the criterion caught it" from "the code moved and nothing fired".
@contextlib.contextmanager
def _patched(owner: object, name: str, replacement: object) -> Iterator[None]:
    original = getattr(owner, name)  # AttributeError: the mutation's target moved; update the mutation
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def kv_head_summed_on_one_rank_only() -> Iterator[list]:
    """Replicated KV heads (n_kv_heads < tp): the head's gradient is summed over its replicas, but the
    second replica keeps its own partial gradient, so the copies drift apart."""
    from meshlm.parallel.tp import ops as tp_ops

    fired: list = []
    original = tp_ops._SumOverHeadReplicas.backward

    def backward(ctx, grad):
        out = original(ctx, grad)
        if dist.get_rank(ctx.group) % 2:
            fired.append(1)
            return (grad, *out[1:])
        return out

    with _patched(tp_ops._SumOverHeadReplicas, "backward", staticmethod(backward)):
        yield fired


@contextlib.contextmanager
def tp_input_gradient_not_all_reduced() -> Iterator[list]:
    """Megatron's f operator without its backward all-reduce: the input gradient of the column-parallel
    linears keeps only this rank's partial sum."""
    from meshlm.parallel.tp import ops as tp_ops

    fired: list = []

    def backward(ctx, grad):
        fired.append(1)
        return grad, None

    with _patched(tp_ops._CopyToTP, "backward", staticmethod(backward)):
        yield fired


@contextlib.contextmanager
def dp_bucket_not_all_reduced(max_numel: int = 1000) -> Iterator[list]:
    """ZeRO-0 skips the gradient all-reduce of its small buckets (the norm weights of the test model's
    vectors buffer): those weights step on their own replica's half of the batch."""
    from meshlm.parallel.dp import data_parallel

    fired: list = []
    original = data_parallel.dist.all_reduce

    class Done:
        def wait(self, *args: object) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        if async_op and tensor.numel() <= max_numel:
            fired.append(1)
            return Done()
        return original(tensor, *args, async_op=async_op, **kwargs)

    with _patched(data_parallel.dist, "all_reduce", all_reduce):
        yield fired


@contextlib.contextmanager
def dp_gradients_all_reduced_twice() -> Iterator[list]:
    """ZeRO-0 runs each bucket's gradient all-reduce twice (a reduction applied twice): every gradient is dp×
    one process's, while the forward pass and the loss agree."""
    from meshlm.parallel.dp import data_parallel

    fired: list = []
    original = data_parallel.dist.all_reduce

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        if async_op:
            fired.append(1)
            original(tensor, *args, **kwargs)
        return original(tensor, *args, async_op=async_op, **kwargs)

    with _patched(data_parallel.dist, "all_reduce", all_reduce):
        yield fired


@contextlib.contextmanager
def zero_shard_offset_off_by_one() -> Iterator[list]:
    """ZeRO ≥ 1: each rank's reduced gradient shard is read one element past its offset (r·n/S + 1), so
    every element is updated with its neighbour's gradient."""
    from meshlm.parallel.dp import data_parallel

    fired: list = []

    class Done:
        def wait(self, *args: object) -> bool:
            return True

    def shifted(out, inp, group=None, async_op=False):
        fired.append(1)
        full = inp.clone()
        dist.all_reduce(full, group=group)
        n, r = out.numel(), dist.get_rank(group)
        out.copy_(full.roll(-1)[r * n : (r + 1) * n])
        return Done() if async_op else None

    with _patched(data_parallel, "reduce_scatter_flat", shifted):
        yield fired


@contextlib.contextmanager
def adam_moments_lost_on_resume() -> Iterator[list]:
    """A resume that restores the weights and step counts but leaves AdamW's moments at zero."""
    this = sys.modules[__name__]
    fired: list = []
    original = this.set_optimizer_steps

    def set_steps(opt: torch.optim.Optimizer, steps: int) -> None:
        original(opt, steps)
        for state in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    fired.append(1)
                    state[key].zero_()

    with _patched(this, "set_optimizer_steps", set_steps):
        yield fired


MUTATIONS = {
    "kv head summed on one rank only": kv_head_summed_on_one_rank_only,
    "tp input gradient not all-reduced": tp_input_gradient_not_all_reduced,
    "dp bucket not all-reduced": dp_bucket_not_all_reduced,
    "zero shard offset off by one": zero_shard_offset_off_by_one,
    "adam moments lost on resume": adam_moments_lost_on_resume,
}


def train_mutated(mutation: str, runs: list[tuple[str, dict, dict]]) -> list[dict]:
    """train_layout(layout, parallel, **kwargs) of each run with `mutation` injected on this rank; each
    result gets 'fired', how often the bug fired on this rank."""
    out = []
    for layout, parallel, kwargs in runs:
        with MUTATIONS[mutation]() as fired:
            result = train_layout(layout, parallel, **kwargs)
        out.append({**result, "fired": len(fired)})
    return out


def assert_mutations_caught(refs: list[dict], per_rank: list[list[dict]], labels: list[str]) -> None:
    """Every mutated run fired its bug on some rank and fails the criterion its optimizer is checked by:
    the loss curve (criterion 1) for AdamW runs, the final weights (criterion 2) for SGD runs."""
    for i, (ref, label) in enumerate(zip(refs, labels, strict=True)):
        assert sum(rank[i]["fired"] for rank in per_rank) > 0, f"{label}: the mutation never fired (code moved?)"
        failures = criterion_failures(ref, per_rank[0][i])
        expected = "weights" if ref.get("optimizer") == "sgd" else "losses"
        assert expected in failures, f"{label}: the {expected} criterion passed a run with the bug ({failures})"
