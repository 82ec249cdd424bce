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
# A wrong plan entry: the blocks' second norm is left out, so under sequence parallel each tp rank keeps the
# gradient of its own sequence shard (it is never summed over tp) and the replicas step apart.
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


@pytest.mark.slow  # five or six torchrun starts (the run, then the step-1 gradients and tp=1): ~2 min on 2 cores
def test_wrong_plan_entry_fails_and_is_localised(tmp_path) -> None:
    report = meshlm.check(make_model, batches(), "tp=2", plan=WRONG_PLAN, sequence_parallel=True, workdir=tmp_path)
    assert not report.passed
    assert report.culprit.startswith("model.layers.0.post_attention_layernorm: grad differs"), report.culprit
    assert "replicated over tp" in report.culprit and "exact with tp=1" in report.culprit, report.culprit
