"""`meshlm.check`: a correct layout passes against one process; a wrong plan entry fails and is localised.

Each check starts torchrun several times (world 1, the layout, the resume; on a failure the step-1 gradient
runs), ~20 s each on a loaded 2-core machine, so these tests are slow.
"""

from __future__ import annotations

import dataclasses

import pytest

import meshlm
from meshlm.model import Transformer, preset
from meshlm.parallel.plans import LLAMA
from meshlm.testing import global_batch

MODEL = preset("test")
# A wrong plan entry: the blocks' second norm is left out of the tp table under sequence parallel. The losses
# stay within 1e-5 over five steps (3e-7); the final weights do not (1e-3 rel).
WRONG_PLAN = dataclasses.replace(
    LLAMA,
    tensor_parallel={k: v for k, v in LLAMA.tensor_parallel.items() if not k.endswith("post_attention_layernorm")},
)


def make_model() -> Transformer:
    return Transformer(MODEL)


def batches() -> list:
    return [global_batch(step, 8, 32, MODEL.vocab_size) for step in range(5)]


@pytest.mark.slow  # three torchrun starts (world 1, tp=2, the resume): ~60 s on 2 cores
def test_correct_plan_passes(tmp_path) -> None:
    report = meshlm.check(make_model, batches(), "tp=2", plan=LLAMA, sequence_parallel=True, workdir=tmp_path)
    assert report.passed, report.to_json()
    assert [r.passed for r in report.rows] == [True, True]


@pytest.mark.slow  # three torchrun starts at dp=2: ~25 s on 2 cores
def test_zero3_passes(tmp_path) -> None:
    """Between steps ZeRO-3 holds only the shards: the check reads each rank's own copies of the weights only
    where they are in memory (it read freed storage, and the ranks died of SIGSEGV)."""
    report = meshlm.check(make_model, batches(), "dp=2", zero=3, workdir=tmp_path)
    assert report.passed, report.to_json()


@pytest.mark.slow  # five torchrun starts (the runs, then the step-1 gradients): ~1.5 min on 2 cores
def test_wrong_plan_entry_fails_and_is_localised(tmp_path) -> None:
    report = meshlm.check(make_model, batches(), "tp=2", plan=WRONG_PLAN, sequence_parallel=True, workdir=tmp_path)
    assert not report.passed
    layout_run = report.rows[0]
    assert layout_run.d_loss <= 1e-5 < layout_run.d_weights, layout_run
    assert layout_run.note.startswith("first tensor whose final weights differ: "), layout_run.note


def test_ids_fold_into_the_replica_vocabulary_keeping_ignored_labels() -> None:
    import torch

    from meshlm.check.run import map_ids

    x = torch.tensor([[5, 130, 257]])
    y = torch.tensor([[130, -100, 300]])
    [(mx, my)] = map_ids([(x, y)], 128, -100)
    assert mx.tolist() == [[5, 2, 1]] and my.tolist() == [[2, -100, 44]]


def test_too_few_steps_is_one_line(capsys) -> None:
    from meshlm.cli import main

    assert main(["check", "--steps", "1", "--model.preset", "test", "--data.seq_len", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--steps 1" in err, err
