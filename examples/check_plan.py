"""`meshlm.check` on a plan with a wrong entry: the layout is run against one process and the check names the
module responsible, with its placement and the layout dimension without which it is exact (docs/check.md).

    python examples/check_plan.py            # the wrong plan: FAIL, exit 1
    python examples/check_plan.py --correct  # meshlm's own plan: PASS, exit 0
"""

from __future__ import annotations

import dataclasses
import sys

import meshlm
from meshlm.check.run import print_verdict
from meshlm.model import Transformer, preset
from meshlm.parallel.plan_registry import LLAMA
from meshlm.testing import global_batch

MODEL = preset("test")
# The wrong entry: the blocks' second RMSNorm left out of the tensor-parallel table under sequence parallel.
WRONG = dataclasses.replace(
    LLAMA,
    tensor_parallel={k: v for k, v in LLAMA.tensor_parallel.items() if not k.endswith("post_attention_layernorm")},
)


def make_model() -> Transformer:
    return Transformer(MODEL)


if __name__ == "__main__":
    plan = LLAMA if "--correct" in sys.argv else WRONG
    batches = [global_batch(step, 8, 32, MODEL.vocab_size) for step in range(5)]
    report = meshlm.check(make_model, batches, "tp=2", plan=plan, sequence_parallel=True, say=print)
    print_verdict(report)
    sys.exit(0 if report.passed else 1)
