"""The suite's two tiers (tests/slow_tier.py), run on a small suite of their own."""

import pytest

SUITE = """
import pytest

@pytest.mark.slow
def test_slow():
    pass

def test_fast():
    pass

@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.slow
def test_slow_grid(size):
    pass
"""


@pytest.mark.parametrize(
    ("args", "outcomes"),
    [
        ((), {"passed": 1, "skipped": 3}),  # a plain run: the slow ones are counted as skipped
        (("--run-slow",), {"passed": 4}),  # make test
        (("-m", "not slow"), {"passed": 1, "deselected": 3}),
        (("-m", "slow"), {"passed": 3, "deselected": 1}),  # a marker choice is obeyed as given
    ],
)
def test_plain_pytest_skips_slow_checks_and_run_slow_runs_them(
    pytester: pytest.Pytester, args: tuple[str, ...], outcomes: dict[str, int]
) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("-p", "slow_tier", *args)
    result.assert_outcomes(**outcomes)
    if "skipped" in outcomes:
        result.stdout.fnmatch_lines(["*3 skipped*"])
        assert "run with --run-slow (make test does)" in pytester.runpytest("-p", "slow_tier", "-rs").stdout.str()


def test_make_test_and_the_portability_run_include_the_slow_tier(request: pytest.FixtureRequest) -> None:
    makefile = (request.config.rootpath / "Makefile").read_text()
    runs = [line for line in makefile.splitlines() if "-m pytest" in line]
    assert len(runs) == 2 and all("-m pytest --run-slow" in line for line in runs), runs
