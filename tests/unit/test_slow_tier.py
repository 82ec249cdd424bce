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
        (("--run-slow",), {"passed": 4}),  # make test-full
        (("-m", "not slow"), {"passed": 1, "deselected": 3}),
        (("-m", "slow"), {"passed": 3, "deselected": 1}),  # make test-slow: a marker choice is obeyed as given
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
        assert "run with --run-slow (make test-full does)" in pytester.runpytest("-p", "slow_tier", "-rs").stdout.str()


def _recipes(makefile: str) -> dict[str, str]:
    """Each Makefile target's pytest command line."""
    out, target = {}, ""
    for line in makefile.splitlines():
        if line and not line[0].isspace() and ":" in line and "=" not in line:
            target = line.split(":")[0]
        elif "-m pytest" in line:
            out[target] = line.split("-m pytest", 1)[1].strip()
    return out


def test_make_test_runs_the_fast_tier_and_ci_runs_each_tier_once(request: pytest.FixtureRequest) -> None:
    """`make test` (the README's command) is the fast tier, `make test-full` everything, `make test-slow` the slow
    tier alone; CI runs `make test` then `make test-slow`, so every check runs and none twice, and the
    portability run reruns the fast tier of the layout-equivalence tests (each pair of strategies once)."""
    root = request.config.rootpath
    recipes = _recipes((root / "Makefile").read_text())
    assert recipes["test"] == "", recipes
    assert recipes["test-full"] == "--run-slow", recipes
    assert recipes["test-slow"] == "-m slow", recipes
    assert recipes["test-portability"] == "$(PORTABILITY_ARGS) $(PARALLEL_TESTS)", recipes
    ci = [line for line in (root / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert ci.index("make test") < ci.index("make test-slow"), ci
