"""Two tiers of one suite: a plain `pytest` skips the checks marked `slow` (about 60 % of the suite's time in
under a tenth of its items; every strategy keeps an equivalence check in the fast tier), `pytest --run-slow`
and `make test` (and so CI) run every one of them.

A slow check is skipped, not deselected, so the summary counts what was left out and says how to run it.
Choosing tests by marker (`-m slow`, `-m 'not slow'`) is an explicit choice and is obeyed as given."""

import pytest

RUN_SLOW = "--run-slow"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(RUN_SLOW, action="store_true", help="also run the checks marked slow (make test does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption(RUN_SLOW) or config.option.markexpr:
        return
    skip = pytest.mark.skip(reason=f"slow: run with {RUN_SLOW} (make test does)")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)
