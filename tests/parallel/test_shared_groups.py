"""The session's machine-speed line (tests/shared_groups.py), on a small suite of its own in a fresh
pytest process: in-process, its end of session would measure and close this session's shared groups."""

from pathlib import Path

import pytest

SUITE = """
import torch.distributed as dist
from distributed import run_shared


def _rank():
    return dist.get_rank()


def test_two_ranks():
    assert run_shared(_rank, 2) == [0, 1]


def test_one_process():
    pass
"""
SPEED_LINE = r"machine speed: 2-rank gloo all_reduce \d+\.\d\d ms, fp32 matmul \d+ GFLOP/s on \d+ threads"


@pytest.mark.slow  # two fresh pytest processes, one starting two ranks: ~11 s
def test_a_session_prints_the_machine_speed_only_after_using_two_ranks(pytester: pytest.Pytester) -> None:
    tests = Path(__file__).parents[1]  # the helper modules: tests/
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(tests)!r})\npytest_plugins = ['shared_groups']\n")
    pytester.makepyfile(SUITE)
    with_ranks = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    with_ranks.assert_outcomes(passed=2)
    with_ranks.stdout.re_match_lines([SPEED_LINE])
    alone = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "one_process")
    alone.assert_outcomes(passed=1, deselected=1)
    alone.stdout.no_re_match_line("machine speed")
