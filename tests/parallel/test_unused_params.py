"""A parameter that got no gradient in a step is skipped exactly as one process's optimizer skips it.

The model is a user's mixture of experts with one nn.Module per expert (an nn.ModuleList) that calls an
expert only when a token is routed to it, so an expert without tokens ends the step with `.grad = None` and
AdamW leaves it alone: no weight decay, no momentum, no step count (which sets its bias correction later).
Routing is by token id (expert = token % 4, the gate learned), so each step's data decides deterministically
which experts get tokens:
  expert 3  none in the whole global batch on even steps; on odd steps only in the last row (the last rank's
            last micro-batch): unused, or used by one rank and one micro-batch only;
  expert 2  only in the first row (the first rank's first micro-batch): used by one rank, not the other.
Every ZeRO stage at dp=2 with two micro-batches per replica is compared with a plain one-process PyTorch loop
on the same global batch: per-step loss (criterion 1 of tests/equivalence.py), each parameter's AdamW step
count, and the final weights, within 1e-3 of one update: an update skipped or applied wrongly moves an
element by the order of the learning rate (3e-3), a correct layout by float rounding only (max 2e-7 measured).
A checkpoint saved at step 5 under ZeRO-3 (expert 3 then has 2 updates, the rest 5) and resumed under ZeRO-1
continues exactly: the per-parameter step counts travel in the checkpoint, the moments per piece.
Reverting the skip (stepping an unused expert with a zero gradient, as before) fails every criterion; so does
counting a buffer complete over two micro-batches' backwards (an early reduction; ZeRO-3 crashes).
A loop of one's own that keeps plain PyTorch's habit of `optimizer.zero_grad()` at the top of each step (the
optimizer tensors' .grad set to None, so autograd accumulates into fresh tensors the reduction never sees)
trains the same under every stage: without FlatBuffer.adopt_grad and the views given back at the end of each
backward, the loss is 2-4 % off from the second step. A backward on top of gradients already reduced for a
step is refused: a new local gradient added to reduced (under ZeRO partly sharded) sums is no one-process sum.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_shared
from equivalence import ADAMW_LR, ADAMW_STEPS, criterion_failures
from torch import nn

import meshlm
from meshlm.checkpoint import step_counts
from meshlm.parallel.mesh import build_mesh, parse_layout

VOCAB, DIM, EXPERTS, BATCH, SEQ, MICRO = 64, 16, 4, 8, 12, 2
WEIGHT_DECAY = 0.1
WEIGHT_ATOL = 1e-3 * ADAMW_LR  # 1e-3 of one AdamW update (|update| ≈ lr per element)


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        gate = self.router(x).softmax(-1)
        route = tokens % EXPERTS
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():  # an expert without tokens is not called: its parameters get no gradient
                out[mask] = expert(x[mask]) * gate[mask][:, e : e + 1]
        return h + out


class ExpertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, tokens)
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`, with the expert routing of the module docstring."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    x[1:] = torch.where(x[1:] % EXPERTS == 2, x[1:] - 2, x[1:])  # expert 2: the first row only
    rows = slice(None) if step % 2 == 0 else slice(None, -1)
    x[rows] = torch.where(x[rows] % EXPERTS == 3, x[rows] - 1, x[rows])  # expert 3: the last row, odd steps
    return x, y


def _optimizer(groups: list[dict]) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=ADAMW_LR, eps=1e-6, foreach=True)


@functools.cache
def plain_loop() -> dict:
    """The reference: one process, plain PyTorch, the whole global batch at once."""
    torch.manual_seed(0)
    model = ExpertModel()
    params = list(model.parameters())
    opt = _optimizer(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    )
    losses = []
    for step in range(ADAMW_STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    steps = {name: int(opt.state[p]["step"]) if p in opt.state else 0 for name, p in model.named_parameters()}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "steps": steps, "weights": weights}


def _train(zero: int, steps: range, run_dir: str | None = None, losses: list[float] | None = None) -> dict:
    """Train `steps` at dp=2 under `zero`, two micro-batches per replica; resume from `run_dir` first when
    it has a checkpoint, save there after."""
    mesh = build_mesh(parse_layout("dp=2", dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    model = meshlm.parallelize(ExpertModel(), mesh, {"zero": zero, "micro_batches": MICRO})
    opt = _optimizer(model.optimizer_param_groups(WEIGHT_DECAY))
    checkpoints = meshlm.Checkpoints(run_dir, async_save=False) if run_dir else None
    if checkpoints is not None:
        checkpoints.load_latest(model, opt)
    losses = list(losses or [])
    for step in steps:
        x, y = batch(step)
        losses.append(model.forward_backward(model.local_batch(x), model.local_batch(y)).item())
        model.step(opt)
    if checkpoints is not None:
        checkpoints.save(steps.stop, model, opt)
    counts = step_counts(model, opt)
    updates = {name: counts["optimizer_steps"] - counts["skipped_steps"].get(name, 0) for name in model.global_shapes}
    return {"losses": losses, "steps": updates, "weights": model.full_state_dict()}


def _habit_train(zero: int) -> dict:
    """A loop of one's own with plain PyTorch's habit of `optimizer.zero_grad()` at the top of each step
    (which sets every optimizer tensor's .grad to None), one micro-batch, forward and backward by hand; then
    a second backward on top of the step's reduced gradients, which must be refused."""
    mesh = build_mesh(parse_layout("dp=2", dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    model = meshlm.parallelize(ExpertModel(), mesh, {"zero": zero})
    opt = _optimizer(model.optimizer_param_groups(WEIGHT_DECAY))
    losses = []
    for step in range(ADAMW_STEPS):
        opt.zero_grad()
        x, y = batch(step)
        local = model.loss_fn(model(model.local_batch(x)), model.local_batch(y))
        model.backward(local)
        losses.append(model.replica_mean(local).item())
        model.step(opt)
    counts = step_counts(model, opt)
    updates = {name: counts["optimizer_steps"] - counts["skipped_steps"].get(name, 0) for name in model.global_shapes}
    out = {"losses": losses, "steps": updates, "weights": model.full_state_dict()}
    x, y = batch(0)
    for _ in range(2):
        try:
            model.backward(model.loss_fn(model(model.local_batch(x)), model.local_batch(y)))
        except RuntimeError as e:
            out["refused"] = str(e)
    return out


def _runs(stages: list[int], run_dir: str) -> list[dict]:
    runs = [_train(zero, range(ADAMW_STEPS)) for zero in stages]
    half = ADAMW_STEPS // 2
    saved = _train(3, range(half), run_dir)
    habits = [_habit_train(zero) for zero in stages]
    return [*runs, _train(1, range(half, ADAMW_STEPS), run_dir, saved["losses"]), *habits]


def weight_failures(ref: dict, got: dict) -> list[str]:
    return [
        f"{name}: max |Δ| {(tensor - got['weights'][name]).abs().max().item():.3g}"
        for name, tensor in ref["weights"].items()
        if not torch.allclose(tensor, got["weights"][name], rtol=0, atol=WEIGHT_ATOL)
    ]


def test_the_reference_skips_what_the_data_says() -> None:
    """The data does what the docstring says: in one process, expert 3 is skipped on even steps (5 of 10
    updates), experts 0-2 never."""
    ref = plain_loop()
    assert ref["steps"]["layers.0.experts.3.up.weight"] == ADAMW_STEPS // 2, ref["steps"]
    assert ref["steps"]["layers.1.experts.2.down.bias"] == ADAMW_STEPS, ref["steps"]
    assert ref["steps"]["head.weight"] == ADAMW_STEPS, ref["steps"]


def test_unused_experts_are_skipped_as_one_process_skips_them_under_every_zero_stage(tmp_path: Path) -> None:
    stages = [0, 1, 2, 3]
    ref = plain_loop()
    results = run_shared(_runs, 2, stages, str(tmp_path), timeout=600)[0]
    habits = [f"{zero}, optimizer.zero_grad() first" for zero in stages]
    for zero, got in zip([*stages, "3 resumed under 1", *habits], results, strict=True):
        assert not criterion_failures(ref, got), (zero, criterion_failures(ref, got))
        assert got["steps"] == ref["steps"], (zero, {n: (ref["steps"][n], s) for n, s in got["steps"].items()})
        assert not weight_failures(ref, got), (zero, weight_failures(ref, got))
    for got in results[len(stages) + 1 :]:
        assert got["refused"].startswith("backward after the gradients were already reduced"), got.get("refused")
