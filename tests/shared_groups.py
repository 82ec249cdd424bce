"""The gloo groups `run_shared` keeps between tests end with the session. Before they end, a session that
used a two-rank group measures this machine on it and prints one line under the summary, e.g.
"machine speed: 2-rank gloo all_reduce 0.71 ms, fp32 matmul 48 GFLOP/s on 2 threads": the suite's wall time
is set by that latency and that rate, which differ twofold between 2-core machines and by half on one VM
over a day, so a time quoted for the suite (README, Testing) says the speed it was measured at."""

from collections.abc import Iterator

import pytest
import torch
from distributed import close_shared_groups, run_shared, shared_group_alive

SPEED = pytest.StashKey[str]()


def machine_speed() -> str:
    from meshlm.observe.doctor import small_all_reduce_seconds
    from meshlm.observe.peak import matmul_flops

    latency = max(run_shared(small_all_reduce_seconds, 2, timeout=60))
    flops = matmul_flops(seconds=0.3)
    return (
        f"machine speed: 2-rank gloo all_reduce {latency * 1e3:.2f} ms, "
        f"fp32 matmul {flops / 1e9:.0f} GFLOP/s on {torch.get_num_threads()} threads"
    )


@pytest.fixture(scope="session", autouse=True)
def shared_process_groups(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    try:
        if shared_group_alive(2):
            request.config.stash[SPEED] = machine_speed()
    finally:
        close_shared_groups()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    line = terminalreporter.config.stash.get(SPEED, None)
    if line:
        terminalreporter.write_line(line)
