"""Two tiers of one suite: a plain `pytest` (and `make test`) skips the checks marked `slow` (most of the suite's
time in under a sixth of its items; every pair of strategies keeps an equivalence run in the fast tier,
tests/parallel/test_compositions.py); `pytest --run-slow` (`make test-full`) runs every one of them, and
`pytest -m slow` (`make test-slow`) only them, which is how CI runs both tiers without running anything twice.
The tiers of speed cut across the suite's folders (tests/conftest.py): unit, parallel and integration each have
slow checks.

A slow check is skipped, not deselected, so the summary counts what was left out and says how to run it.
Choosing tests by marker (`-m slow`, `-m 'not slow'`) is an explicit choice and is obeyed as given."""

import pytest

RUN_SLOW = "--run-slow"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(RUN_SLOW, action="store_true", help="also run the checks marked slow (make test-full does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption(RUN_SLOW) or config.option.markexpr:
        return
    skip = pytest.mark.skip(reason=f"slow: run with {RUN_SLOW} (make test-full does)")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)
