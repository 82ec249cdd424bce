"""The suite's shared fixtures, for its three tiers by folder:

- tests/unit/: in the pytest process, no ranks started and no subprocess beyond a CLI call;
- tests/parallel/: gloo ranks started by tests/distributed.py, each layout against the single-process run
  (equivalence, mutations, sharded checkpoints);
- tests/integration/: meshlm run as a user or a scheduler runs it: torchrun, `meshlm launch`, Slurm, signals,
  injected faults, exports read back by transformers and PEFT.

The helper modules (distributed, equivalence, dp_helpers, check_models, run_args, sft_data, shared_groups,
slow_tier, cpu_time, slurm_cluster) stay in tests/ and are imported by name (`from distributed import
run_shared`): tests/ is put on sys.path here. `pytest --cpu-times FILE` (tests/cpu_time.py) ranks tests by the
CPU seconds of their process trees, which a loaded machine changes far less than their wall time.
A name two test modules share belongs in one of them, not in a test module (some still import another's: the
tier folders are on sys.path too, so that works from any folder).
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
# A test module that imports another one's names (`from test_moe import MOE_MODEL`) finds it in any tier.
sys.path[1:1] = [str(TESTS / tier) for tier in ("unit", "parallel", "integration")]

# The suite runs the same examples on every machine (a red CI is never a draw); MESHLM_HYPOTHESIS=explore
# searches fresh examples, as a session hunting for new bad inputs does. No per-example deadline: hypothesis's
# default 200 ms is a wall-clock bar that a loaded machine misses (the planner's layout properties did, at load
# 50) while the property checks values, not speed — speed is the benchmarks' job.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile("explore" if os.environ.get("MESHLM_HYPOTHESIS") == "explore" else "repeatable")

pytest_plugins = ["pytester", "slow_tier", "shared_groups", "cpu_time"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token cache for the session: a slice of the standard-library corpus, tokenized once."""
    return str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture
def small_run(data_cache: str, tmp_path: Path) -> list[str]:
    """tests/run_args.py's overrides for a short run in this test's own directory."""
    from run_args import small_run_args  # tests/ is on sys.path (above)

    return small_run_args(data_cache, tmp_path / "run")
