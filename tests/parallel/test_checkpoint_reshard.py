"""Sharded checkpoints: resume equals an uninterrupted run under every layout, and a checkpoint saved under
one layout resumes under others, at other world sizes: the resumed run starts from exactly the saved weights
(bit for bit: loading reshards bytes, it does no arithmetic) and continues the uninterrupted run's AdamW loss
curve and gradient norms (1e-5 relative, tests/equivalence.py), which needs Adam's moments restored too: a
resume that loses them fails that criterion."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from equivalence import (
    TEST_MODEL,
    assert_close_runs,
    assert_identical_weights,
    criterion_failures,
    reference,
    tail,
    train_layout,
    train_mutated,
)

from meshlm.checkpoint import init_optimizer_state, training_entries
from meshlm.config import TrainSection
from meshlm.model import Transformer
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train.optim import build_optimizer

STEPS, SAVE_AT = 10, 5


def micro_batch(layout: str) -> int:
    """Sequences per micro-batch: 2 where a pipeline schedule needs several micro-batches, else the whole
    replica batch at once. Accumulation runs the same checkpointed state; TP layouts make ~30 all-reduces
    per micro-batch (~5 ms each at 4 ranks on 2 cores), so accumulating there would only cost time."""
    return 2 if "pp=" in layout else 0


SAVED_AT_8 = ("pp=2,dp=2,tp=2", {"zero": 1, "sequence_parallel": True})

# (layout, parallel options): every strategy and composition at world size 4.
SAME_LAYOUT_4 = [
    ("dp=4", {"zero": 0}),
    ("dp=4", {"zero": 1}),
    ("dp=4", {"zero": 2}),
    ("dp=4", {"zero": 3}),
    ("dp=4", {"zero": 2, "zero_shard_size": 2}),
    ("tp=4", {}),
    ("dp=2,tp=2", {"zero": 3, "sequence_parallel": True}),
    ("pp=4", {"schedule": "1f1b"}),
    ("pp=2,dp=2", {"schedule": "gpipe", "zero": 2}),
    ("pp=2,tp=2", {"schedule": "interleaved", "virtual_stages": 2}),
]
# Loads of the world-8 checkpoint under other layouts and world sizes.
RESHARD_4 = [("dp=4", {"zero": 3}), ("pp=2,tp=2", {}), ("tp=4", {"sequence_parallel": True})]
RESHARD_2 = [("tp=2", {}), ("pp=2", {"schedule": "1f1b"})]
RESHARD_1 = [("", {})]


def segment(layout: str, parallel: dict, run: str, first_half: bool) -> dict:
    if first_half:
        return train_layout(layout, parallel, steps=STEPS, stop=SAVE_AT, micro_batch=micro_batch(layout), save_to=run)
    return train_layout(layout, parallel, steps=STEPS, start=SAVE_AT, micro_batch=micro_batch(layout), resume_from=run)


def same_layout_job(root: str, cases: list) -> list[tuple[dict, dict]]:
    """(the first half's final weights, the resumed second half) per layout."""
    out = []
    for i, (layout, parallel) in enumerate(cases):
        run = f"{root}/same{i}"
        saved = segment(layout, parallel, run, first_half=True)["state"]
        out.append((saved, segment(layout, parallel, run, first_half=False)))
    return out


def save_job(run: str) -> dict:
    return segment(*SAVED_AT_8, run, first_half=True)["state"]


def resume_job(run: str, cases: list, mutated: list | None = None) -> dict:
    """Each case resumed from `run`; and the `mutated` ones resumed with Adam's moments lost."""
    resume = {"steps": STEPS, "start": SAVE_AT, "resume_from": run}
    return {
        "runs": [segment(layout, parallel, run, first_half=False) for layout, parallel in cases],
        "mutated": train_mutated(
            "adam moments lost on resume",
            [(layout, parallel, {**resume, "micro_batch": micro_batch(layout)}) for layout, parallel in mutated or []],
        ),
    }


def _resume_reference(layout: str) -> dict:
    """The uninterrupted run's curve from SAVE_AT on (with the layout's accumulation): what every resumed
    run must continue. A world-8 checkpoint (2 sequences per micro-batch) resumed without accumulation
    differs from it by float summation order only, far inside the criterion's 1e-5."""
    return tail(reference(micro_batch=micro_batch(layout)), SAVE_AT)


@pytest.fixture(scope="module")
def saved_at_world_8() -> tuple[str, dict]:
    root = tempfile.mkdtemp(prefix="meshlm-reshard-")
    return root, run_shared(save_job, 8, root, timeout=300)[0]


def _assert_resumed(saved: dict, got: dict, layout: str, label: str) -> None:
    try:
        assert_identical_weights(saved, got["resumed_state"])
        assert_close_runs(_resume_reference(layout), got)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


@pytest.mark.slow  # ten layouts saved and resumed on four ranks: ~18 s
def test_resume_equals_uninterrupted_for_every_layout(tmp_path: Path) -> None:
    results = run_shared(same_layout_job, 4, str(tmp_path), SAME_LAYOUT_4, timeout=400)
    for (layout, parallel), (saved, got) in zip(SAME_LAYOUT_4, results[0], strict=True):
        _assert_resumed(saved, got, layout, f"{layout} {parallel}")


MUTATED_4 = [("dp=4", {"zero": 1}), ("pp=2,tp=2", {})]


@pytest.mark.parametrize("world, cases", [(8, [SAVED_AT_8]), (4, RESHARD_4), (2, RESHARD_2), (1, RESHARD_1)])
def test_resume_under_another_layout_and_world_size(
    saved_at_world_8: tuple[str, dict], world: int, cases: list
) -> None:
    run, saved = saved_at_world_8
    mutated = MUTATED_4 if world == 4 else []
    results = run_shared(resume_job, world, run, cases, mutated, timeout=300)[0]
    for (layout, parallel), got in zip(cases, results["runs"], strict=True):
        _assert_resumed(saved, got, layout, f"{SAVED_AT_8} -> world {world} {layout} {parallel}")
    for case, got in zip(mutated, results["mutated"], strict=True):  # losing the moments is caught
        assert got["fired"], case
        assert_identical_weights(saved, got["resumed_state"])  # the weights alone cannot tell
        assert "losses" in criterion_failures(_resume_reference(case[0]), got), case


def writer_share_job(cases: list) -> list[tuple[int, int]]:
    """(elements this rank writes, elements of the whole model state) per layout, after one step."""
    out = []
    for layout, parallel in cases:
        world = dist.get_world_size()
        lay = parse_layout(layout, world)
        torch.manual_seed(0)
        pm = parallelize(Transformer(TEST_MODEL), build_mesh(lay, "cpu"), parallel)
        opt = build_optimizer(pm, TrainSection())
        init_optimizer_state(opt)
        written = sum(v.numel() for e in training_entries(pm, opt, writer=True).values() for v in e.views)
        out.append((written, 3 * sum(p.numel() for p in Transformer(TEST_MODEL).parameters())))
    return out


def test_replicas_share_the_writing_and_write_every_element_once() -> None:
    """Under ZeRO-0 every rank holds the whole state; as writers, each takes about a quarter (DCP would
    otherwise stage and deduplicate everything), and over the ranks every element is written exactly once."""
    cases = [("dp=4", {"zero": 0}), ("dp=4", {"zero": 2, "zero_shard_size": 2}), ("dp=2,tp=2", {"zero": 0})]
    ranks = run_shared(writer_share_job, 4, cases)
    for i, case in enumerate(cases):
        written = [r[i][0] for r in ranks]
        total = ranks[0][i][1]
        assert sum(written) == total, (case, written, total)
        assert max(written) < 0.3 * total, (case, written)
