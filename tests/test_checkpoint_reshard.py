"""Sharded checkpoints: resume equals an uninterrupted run under every layout, and a checkpoint saved under
one layout resumes under others, at other world sizes, continuing the same loss curve (1e-5 relative) to the
same final weights, Adam moments included."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from equivalence import TEST_MODEL, assert_close_runs, train_layout

from meshlm.checkpoint import init_optimizer_state, training_entries
from meshlm.config import ParallelSection, TrainSection
from meshlm.model import Transformer
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train.optim import build_optimizer

STEPS, SAVE_AT, MICRO = 10, 5, 2
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
        return train_layout(layout, parallel, steps=STEPS, stop=SAVE_AT, micro_batch=MICRO, save_to=run)
    return train_layout(layout, parallel, steps=STEPS, start=SAVE_AT, micro_batch=MICRO, resume_from=run)


def same_layout_job(root: str, cases: list) -> list[dict]:
    out = []
    for i, (layout, parallel) in enumerate(cases):
        run = f"{root}/same{i}"
        segment(layout, parallel, run, first_half=True)
        out.append(segment(layout, parallel, run, first_half=False))
    return out


def save_job(run: str) -> dict:
    return segment(*SAVED_AT_8, run, first_half=True)


def resume_job(run: str, cases: list) -> list[dict]:
    return [segment(layout, parallel, run, first_half=False) for layout, parallel in cases]


@pytest.fixture(scope="module")
def reference() -> dict:
    full = train_layout(steps=STEPS)
    return {"losses": full["losses"][SAVE_AT:], "state": full["state"]}


@pytest.fixture(scope="module")
def saved_at_world_8() -> str:
    root = tempfile.mkdtemp(prefix="meshlm-reshard-")
    run_distributed(save_job, 8, root, timeout=300)
    return root


def test_resume_equals_uninterrupted_for_every_layout(reference: dict, tmp_path: Path) -> None:
    results = run_distributed(same_layout_job, 4, str(tmp_path), SAME_LAYOUT_4, timeout=400)
    for (layout, parallel), got in zip(SAME_LAYOUT_4, results[0], strict=True):
        try:
            assert_close_runs(reference, got)
        except AssertionError as e:
            raise AssertionError(f"{layout} {parallel}: {e}") from None


@pytest.mark.parametrize("world, cases", [(8, [SAVED_AT_8]), (4, RESHARD_4), (2, RESHARD_2), (1, RESHARD_1)])
def test_resume_under_another_layout_and_world_size(
    reference: dict, saved_at_world_8: str, world: int, cases: list
) -> None:
    results = run_distributed(resume_job, world, saved_at_world_8, cases, timeout=300)
    for (layout, parallel), got in zip(cases, results[0], strict=True):
        try:
            assert_close_runs(reference, got)
        except AssertionError as e:
            raise AssertionError(f"{SAVED_AT_8} -> world {world} {layout} {parallel}: {e}") from None


def writer_share_job(cases: list) -> list[tuple[int, int]]:
    """(elements this rank writes, elements of the whole model state) per layout, after one step."""
    out = []
    for layout, parallel in cases:
        world = dist.get_world_size()
        lay = parse_layout(layout, world)
        torch.manual_seed(0)
        pm = ParallelModel(Transformer(TEST_MODEL), build_mesh(lay, "cpu"), ParallelSection(**parallel), n_micro=1)
        opt = build_optimizer(pm, TrainSection())
        init_optimizer_state(opt)
        written = sum(v.numel() for e in training_entries(pm, opt, writer=True).values() for v in e.views)
        out.append((written, 3 * sum(p.numel() for p in Transformer(TEST_MODEL).parameters())))
    return out


def test_replicas_share_the_writing_and_write_every_element_once() -> None:
    """Under ZeRO-0 every rank holds the whole state; as writers, each takes about a quarter (DCP would
    otherwise stage and deduplicate everything), and over the ranks every element is written exactly once."""
    cases = [("dp=4", {"zero": 0}), ("dp=4", {"zero": 2, "zero_shard_size": 2}), ("dp=2,tp=2", {"zero": 0})]
    ranks = run_distributed(writer_share_job, 4, cases)
    for i, case in enumerate(cases):
        written = [r[i][0] for r in ranks]
        total = ranks[0][i][1]
        assert sum(written) == total, (case, written, total)
        assert max(written) < 0.3 * total, (case, written)
