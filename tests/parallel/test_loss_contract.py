"""The loss contract: a causal-LM loss ignores -100 labels and is normalised by the kept tokens of the *global*
batch, under every layout and with gradient accumulation, equal to a plain one-process PyTorch loop using
`F.cross_entropy(ignore_index=-100, reduction="sum") / kept`.

The labels are fine-tuning-like (tests/equivalence.py `masked`, meshlm.testing.mask_prompts): about 30% of them
-100, unevenly per row, so replicas, micro-batches and cp shards each keep a different number of tokens — the
case where a per-replica or per-micro-batch mean (the gradient-accumulation bug Hugging Face transformers fixed
in 2024) differs from the global token mean. Criterion 1 of tests/equivalence.py (per-step loss and gradient
norm within 1e-5 relative) over ten AdamW steps; the mutations below (a per-micro-batch mean, -100 counted as a
token) must fail it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_shared
from equivalence import (
    ADAMW_LR,
    ADAMW_STEPS,
    TEST_MODEL,
    _patched,
    assert_same_losses,
    criterion_failures,
    train_layout,
)

import meshlm
from meshlm.config import TrainSection
from meshlm.model import Transformer
from meshlm.parallel import engine
from meshlm.parallel.engine import LossShapeError
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.parallel_plan import PlanError
from meshlm.testing import global_batch, mask_prompts
from meshlm.train.optim import lr_at

MASKED = 0.3  # fraction of labels that are -100
BATCH, SEQ = 8, 32
TIED = TEST_MODEL.replace(tie_embeddings=True)


def plain_loop(model_cfg=TEST_MODEL, steps: int = ADAMW_STEPS, masked: float = MASKED) -> dict:
    """The reference: meshlm's model in a plain PyTorch loop, no meshlm parallel code at all."""
    torch.manual_seed(0)
    model = Transformer(model_cfg)
    train = TrainSection(steps=steps, global_batch=BATCH, lr=ADAMW_LR, eps=1e-6, warmup_steps=2, grad_clip=1.0)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step, BATCH, SEQ, model_cfg.vocab_size)
        y = mask_prompts(y, step, masked)
        logits = model(x).float().flatten(0, 1)
        kept = (y != -100).sum()
        loss = F.cross_entropy(logits, y.flatten(), ignore_index=-100, reduction="sum") / kept
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, train.grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


# ---- mutations -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def per_micro_batch_mean() -> Iterator[list]:
    """Each micro-batch's own token mean, divided by the micro-batch count: exact only when every micro-batch
    keeps as many tokens (the pre-2024 gradient-accumulation normalisation)."""
    fired: list = []

    def scaled(self, output, targets):
        fired.append(1)
        kept = (targets != self.ignore_index).sum().clamp(min=1)
        return self.token_loss_sum(output, targets) / kept / self.n_micro

    with _patched(engine.ParallelModel, "_scaled_loss", scaled):
        yield fired


@contextlib.contextmanager
def ignored_labels_counted() -> Iterator[list]:
    """-100 labels treated as tokens by the vocabulary-parallel cross-entropy (and not masked after it)."""
    from meshlm.parallel.tp import sharding as tensor_parallel

    fired: list = []
    original = tensor_parallel.vocab_parallel_cross_entropy

    def counted(logits, targets, group, ignore_index=-100):
        fired.append(1)
        return original(logits, targets, group, ignore_index=-1)

    def unmasked_sum(self, output, targets):
        return self.token_loss(output, targets).float().sum()

    with (
        _patched(tensor_parallel, "vocab_parallel_cross_entropy", counted),
        _patched(engine.ParallelModel, "token_loss_sum", unmasked_sum),
    ):
        yield fired


MUTATIONS = {"per-micro-batch mean": per_micro_batch_mean, "-100 counted": ignored_labels_counted}

# (layout, parallel section, train_layout options): world 2. micro_batch 2 of 4 rows per replica = 2 micro-batches.
RUNS_2 = [
    ("dp=2", {"zero": 3}, {"micro_batch": 2}),
    ("dp=2", {"zero": 0}, {"model_cfg": TIED}),
    ("tp=2", {}, {}),
    ("tp=2", {"sequence_parallel": True}, {"model_cfg": TIED, "micro_batch": 4}),
    ("pp=2", {"schedule": "1f1b"}, {"micro_batch": 2}),
    ("cp=2", {}, {}),
    ("cp=2", {"cp_attention": "ulysses"}, {"micro_batch": 4}),
]
MUTATED_2 = [
    ("per-micro-batch mean", "dp=2", {"zero": 3}, {"micro_batch": 2}),
    ("per-micro-batch mean", "pp=2", {}, {"micro_batch": 2}),
    ("-100 counted", "tp=2", {}, {}),
]
RUNS_4 = [
    ("dp=2,tp=2", {"zero": 1}, {"micro_batch": 2}),
    ("dp=2,tp=2", {"zero": 3, "sequence_parallel": True}, {"model_cfg": TIED}),
    ("dp=2,cp=2", {"zero": 2}, {"micro_batch": 2}),
]


def _runs(runs: list, mutated: list) -> dict:
    out = {"runs": [train_layout(layout, par, masked=MASKED, **kw)["losses"] for layout, par, kw in runs]}
    out["mutated"] = []
    for name, layout, par, kw in mutated:
        with MUTATIONS[name]() as fired:
            losses = train_layout(layout, par, masked=MASKED, steps=3, **kw)["losses"]
        out["mutated"].append({"losses": losses, "fired": len(fired)})
    return out


def _check(results: list[dict], runs: list, mutated: list) -> None:
    refs = {cfg: plain_loop(cfg) for cfg in (TEST_MODEL, TIED)}
    for (layout, par, kw), losses in zip(runs, results[0]["runs"], strict=True):
        ref = refs[kw.get("model_cfg", TEST_MODEL)]["losses"]
        assert not criterion_failures({"losses": ref}, {"losses": losses}), (layout, par, kw, ref, losses)
    short = {"losses": refs[TEST_MODEL]["losses"][:3]}
    for i, (name, layout, par, _) in enumerate(mutated):
        assert sum(rank["mutated"][i]["fired"] for rank in results) > 0, f"{name} never fired under {layout}"
        got = {"losses": results[0]["mutated"][i]["losses"]}
        assert "losses" in criterion_failures(short, got), f"{name} under {layout} {par} passed the loss check"


def test_one_process_meshlm_equals_the_plain_loop_with_masked_labels() -> None:
    """meshlm's own loop at world 1, with and without accumulation and tied weights, against the plain loop; and
    the masked labels really are uneven (else the mutations could not tell a per-micro-batch mean apart)."""
    ref = plain_loop()
    for kwargs in ({}, {"micro_batch": 2}, {"micro_batch": 1}):
        assert_same_losses(ref, train_layout("", masked=MASKED, **kwargs))
    assert_same_losses(plain_loop(TIED), train_layout("", model_cfg=TIED, masked=MASKED))
    y = mask_prompts(global_batch(0, BATCH, SEQ, 256)[1], 0, MASKED)
    kept_per_row = (y != -100).sum(1)
    assert kept_per_row.unique().numel() > 3 and 0.2 < (y == -100).float().mean() < 0.45


def test_every_layout_matches_the_plain_loop_with_masked_labels_world_2() -> None:
    _check(run_shared(_runs, 2, RUNS_2, MUTATED_2, timeout=600), RUNS_2, MUTATED_2)


@pytest.mark.slow  # ~20 s on a 2-vCPU VM: three four-rank runs of ten steps
def test_every_layout_matches_the_plain_loop_with_masked_labels_world_4() -> None:
    _check(run_shared(_runs, 4, RUNS_4, [], timeout=600), RUNS_4, [])


# ---- a loop of one's own: model.loss_fn with num_tokens --------------------------------------------------
def _custom_loop(layout: str, accumulate: bool) -> list[float]:
    mesh = build_mesh(parse_layout(layout, dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    model = meshlm.parallelize(Transformer(TEST_MODEL), mesh, {"zero": 1})
    opt = torch.optim.AdamW(model.optimizer_param_groups(0.1), lr=ADAMW_LR, eps=1e-6, betas=(0.9, 0.95))
    train = TrainSection(steps=ADAMW_STEPS, global_batch=BATCH, lr=ADAMW_LR, warmup_steps=2)
    losses = []
    for step in range(ADAMW_STEPS):
        x, y = global_batch(step, BATCH, SEQ, TEST_MODEL.vocab_size)
        x, y = model.local_batch(x), model.local_batch(mask_prompts(y, step, MASKED))
        if accumulate:  # two micro-batches, normalised by the step's global kept tokens
            num_tokens = model.count_tokens(y)
            total = torch.zeros(())
            with model.no_sync():
                part = model.loss_fn(model(x[:2]), y[:2], num_tokens)
                model.backward(part)
            part2 = model.loss_fn(model(x[2:]), y[2:], num_tokens)
            model.backward(part2)
            total = part.detach() + part2.detach()
        else:
            total = model.loss_fn(model(x), y)
            model.backward(total)
        model.clip_grad_norm_(1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        model.step(opt)
        losses.append(model.replica_mean(total).item())
    return losses


def test_a_loop_of_ones_own_with_loss_fn_and_num_tokens_matches_the_plain_loop() -> None:
    ref = plain_loop()
    for losses in run_shared(_custom_loop, 2, "dp=2", True)[0], run_shared(_custom_loop, 2, "dp=2", False)[0]:
        assert_same_losses({"losses": ref["losses"]}, {"losses": losses})


# ---- refusals: one line, before any step -------------------------------------------------------------------
def _refusals() -> dict[str, str]:
    world = dist.get_world_size()
    out = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = "accepted"
        except PlanError as e:
            out[name] = f"{type(e).__name__}: {e}"

    x, y = global_batch(0, BATCH, SEQ, TEST_MODEL.vocab_size)
    dp_mesh = build_mesh(parse_layout("dp=2", world), "cpu")
    torch.manual_seed(0)
    dp_model = meshlm.parallelize(Transformer(TEST_MODEL), dp_mesh, {"micro_batches": 2})
    attempt("global batch on every rank", lambda: dp_model.forward_backward(x, y))
    attempt("odd rows", lambda: dp_model.forward_backward(x[:3], y[:3]))

    def scalar_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    attempt("scalar loss", lambda: meshlm.parallelize(Transformer(TEST_MODEL), dp_mesh, loss=meshlm.Loss(scalar_loss)))
    pp_mesh = build_mesh(parse_layout("pp=2", world), "cpu")  # refused on every stage, not on the last at step 1
    attempt(
        "scalar loss under pp",
        lambda: meshlm.parallelize(
            Transformer(TEST_MODEL), pp_mesh, {"micro_batches": 2}, loss=meshlm.Loss(scalar_loss)
        ),
    )
    tp_mesh = build_mesh(parse_layout("tp=2", world), "cpu")
    attempt(
        "own loss on sharded logits",
        lambda: meshlm.parallelize(Transformer(TEST_MODEL), tp_mesh, loss=meshlm.Loss(lambda out, t: out.sum(-1))),
    )
    return out


def test_bad_batches_and_losses_are_one_line_refusals() -> None:
    ranks = run_shared(_refusals, 2)
    assert ranks[0]["scalar loss under pp"] == ranks[1]["scalar loss under pp"]  # both stages, before any step
    out = ranks[0]
    assert "every one of the 2 dp ranks got the same 8 rows" in out["global batch on every rank"]
    assert "model.local_batch" in out["global batch on every rank"]
    assert "3 rows do not split into 2 micro-batches" in out["odd rows"]
    for name in ("scalar loss", "scalar loss under pp"):
        assert out[name].startswith(LossShapeError.__name__) and "reduction='none'" in out[name], out[name]
    assert "gather_logits=True" in out["own loss on sharded logits"]
    assert all("\n" not in line for line in out.values()), out


def test_fit_refuses_data_that_disagrees_with_global_batch(tmp_path) -> None:
    """train.global_batch sets tokens/s, MFU and the schedule: data of another size is one line, not a run
    that reports twice the throughput it has."""
    from meshlm.config import Config, ConfigError

    cfg = Config.model_validate(
        {
            "train": {"steps": 2, "global_batch": 4, "device": "cpu", "eval_every": 0},
            "data": {"seq_len": SEQ},
            "checkpoint": {"every": 0, "async_save": False},
            "log": {"run_dir": str(tmp_path), "progress": False, "tensorboard": False, "aggregate_every": 0},
            "fault": {"desync_every": 0, "watchdog_s": 0},
        }
    )
    batches = [global_batch(step, BATCH, SEQ, TEST_MODEL.vocab_size) for step in range(2)]
    with pytest.raises(ConfigError, match=r"train.global_batch = 4, but the data gave this dp rank 8 rows"):
        meshlm.fit(cfg, model=lambda: Transformer(TEST_MODEL), data=batches)
