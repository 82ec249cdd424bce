"""`meshlm.check` names the plan entry that is wrong, not the module after it (issue 47), on the KBias user model
(tests/check_models.py) at tp=2:

- a blocked [Q | K | V] `qkv` declared per head (InterleavedColwise): qkv's output, gathered as its entry
  places it, agrees with one process's; `attn.dense` is the first module whose output differs, and its input
  already does, so the colwise entry whose columns `attn`'s code reads is named (before: `attn.dense`);
- a plain `mlp.up` declared FusedColwise(2): the same through `mlp.down` (before: `mlp.down`);
- a row-parallel `mlp.down` declared colwise: a shape error in its forward, named with its entry (before: a bare
  "mat1 and mat2 shapes cannot be multiplied" naming no module);
- a Linear added between `up` and `down` with no plan entry: the shape error named as that module, without an
  entry (before: the same bare error).

Mutation of the fix: with meshlm.check.run.first_module_differs comparing raw outputs only (no gathering, no
input comparison) the first two name `attn.dense` / `mlp.down`; without meshlm.check.worker.where_raised the
last two raise CheckError with the bare shape error.

The factories switch off `parallelize`'s build-time tp probe where the tree has one (it refuses all four before
step 1, naming the entry): what is tested is the check's own localisation.

The first two are 4 torchrun starts each (60-150 s on 2 shared cores), the last two one each (10-30 s).
"""

from __future__ import annotations

import json

import pytest
from check_models import (
    DOWN_COLWISE,
    FUSED_UP,
    KBIAS_PLAN,
    PER_HEAD_QKV,
    batches,
    kbias_unprobed,
    kbias_with_mid_unprobed,
)

import meshlm

# (model factory, plan; how the culprit starts, what it says of the entry)
CASES = {
    "blocked qkv declared per head": (
        kbias_unprobed, PER_HEAD_QKV, "layers.0.attn.qkv: its output agrees gathered",
        "plan entry 'layers.*.attn.qkv': InterleavedColwise(per_head=3)",
    ),
    "plain up declared fused": (
        kbias_unprobed, FUSED_UP, "layers.0.mlp.up: its output agrees gathered",
        "plan entry 'layers.*.mlp.up': FusedColwise(",
    ),
    "row-parallel down declared colwise": (
        kbias_unprobed, DOWN_COLWISE,
        "layers.0.mlp.down (plan entry 'layers.*.mlp.down': colwise): raised at the layout",
        "mat1 and mat2 shapes cannot be multiplied",
    ),
    "a new Linear with no plan entry": (
        kbias_with_mid_unprobed, KBIAS_PLAN, "layers.0.mlp.mid (no plan entry in 'kbias'", "raised at the layout",
    ),
}  # fmt: skip


@pytest.mark.slow  # 1-4 torchrun starts each: 10-150 s on 2 shared cores
@pytest.mark.parametrize("case", CASES)
def test_the_wrong_entry_is_named(case: str, tmp_path) -> None:
    factory, plan, start, entry = CASES[case]
    report = meshlm.check(factory, batches(), "tp=2", plan=plan, workdir=tmp_path)
    out = json.loads(report.to_json())
    assert not out["passed"] and not out["checks"][0]["passed"], out
    assert out["culprit"].startswith(start) and entry in out["culprit"], out["culprit"]
    if "raised" in start or "raised" in entry:  # the layout run stopped: no reference, no localisation runs
        assert list(out["phases_s"]) == ["layout tp=2 (2 ranks)"], out["phases_s"]
    else:
        assert "exact with tp=1" in out["culprit"], out["culprit"]
