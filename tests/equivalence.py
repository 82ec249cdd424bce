"""Train a tiny model under any layout and return its per-step losses and final full weights.

Every parallel layout is tested by comparing this against the same function at world size 1:
same seed, same global batches, same optimizer — only the layout differs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshlm.checkpoint import (
    Checkpointer,
    init_optimizer_state,
    latest_valid_checkpoint,
    set_optimizer_steps,
    training_entries,
)
from meshlm.config import ParallelSection, TrainSection
from meshlm.model import ModelConfig, Transformer, preset
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.mesh import build_mesh, parse_layout, validate_layout
from meshlm.train.optim import build_optimizer, lr_at, train_step

TEST_MODEL = preset("test")
SGD_LR = 0.5


def global_batch(step: int, batch: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (a random start, then a fixed affine rule with occasional random tokens), a pure
    function of (seed, step): the same global batch for every layout, and a loss that really falls."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(1, seq_len + 1):
        tokens[:, t] = (tokens[:, t - 1] * 5 + 3) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_layout(
    layout: str = "",
    parallel: dict | None = None,
    steps: int = 10,
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
    lr: float | None = None,
) -> dict:
    """Run optimizer steps `start`..`stop - 1` of a `steps`-step schedule (all of them by default); return
    {'losses', 'grad_norms', 'state' (full fp32 weights)}.

    `resume_from` loads the newest checkpoint of that run directory first (written under any layout);
    `save_to` saves a sharded checkpoint of step `stop` there at the end."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    par = ParallelSection(layout=layout, **(parallel or {}))
    # Adam amplifies last-bit differences of tiny gradients by about lr/eps; eps=1e-6 keeps that well below
    # the 1e-5 weight tolerance while still testing the real optimizer.
    train = TrainSection(
        steps=steps,
        global_batch=batch,
        micro_batch=micro_batch,
        lr=lr if lr is not None else (SGD_LR if optimizer == "sgd" else 3e-3),
        eps=1e-6,
        warmup_steps=2,
        grad_clip=grad_clip,
        seed=seed,
    )
    lay = parse_layout(layout, world)
    n_micro = validate_layout(
        lay, model_cfg, batch, micro_batch, par.virtual_stages, par.schedule, seq_len, par.sequence_parallel
    )
    mesh = build_mesh(lay, "cpu")
    torch.manual_seed(seed)
    model = Transformer(model_cfg)
    pm = ParallelModel(model, mesh, par, n_micro)
    if optimizer == "sgd":
        opt = torch.optim.SGD(pm.optimizer_param_groups(train.weight_decay), lr=train.lr, foreach=True)
    else:
        opt = build_optimizer(pm, train)
    if resume_from or save_to:
        checkpointer = Checkpointer(resume_from or save_to, keep=2, async_save=False, timeout_s=60)
    if resume_from:
        init_optimizer_state(opt)
        checkpointer.load(latest_valid_checkpoint(resume_from), training_entries(pm, opt))
        set_optimizer_steps(opt, start)
        pm.after_load()
    dp_rank, dp = mesh.rank("dp"), lay.dp
    losses, norms, lrs = [], [], []
    stop = steps if stop is None else stop
    for step in range(start, stop):
        x, y = global_batch(step, batch, seq_len, model_cfg.vocab_size, seed)
        rows = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
        lrs.append(lr_at(step, train))
        loss, norm, _ = train_step(pm, opt, x[rows], y[rows], lrs[-1], train.grad_clip)
        losses.append(loss)
        norms.append(norm)
    if save_to:
        checkpointer.save(stop, training_entries(pm, opt, writer=True), {"step": stop})
    return {"losses": losses, "grad_norms": norms, "state": pm.full_state_dict(), "optimizer": optimizer, "lrs": lrs}


def assert_close_runs(ref: dict, got: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Per-step losses within rtol relative, and every final weight within atol (max abs difference)."""
    assert len(ref["losses"]) == len(got["losses"])
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(a), f"step {step}: loss {b} vs reference {a}"
    assert ref["state"].keys() == got["state"].keys(), set(ref["state"]) ^ set(got["state"])
    for name, ref_tensor in ref["state"].items():
        diff = (ref_tensor - got["state"][name]).abs().max().item()
        assert diff <= atol, f"{name}: max |Δ| = {diff}"
