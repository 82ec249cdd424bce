"""CPU seconds per test, for ranking the suite's costs on a machine that others load: `pytest --cpu-times FILE`
writes one JSON line per test (node id, CPU seconds of the pytest process and every process under it, wall
seconds, outcome) and prints the costliest under the summary.

Wall time on a shared 2-core machine says more about the neighbours than about the test; CPU time counts the
work. A test's CPU is the change, from before its setup to after its teardown, of: this process's own time and
its reaped children's (getrusage), plus, for each live process under it (forkserver ranks, a shared gloo group
kept between tests, torchrun and its workers), its time and its reaped children's (/proc/PID/stat). A process
alive at the start and reaped during the test moves from the second sum into the first with its whole time, so
the difference counts only what it spent during the test. Time spent waiting is not counted: a rank blocked on a
collective or a sleep costs nothing here, though it costs wall time; nor does a process outside this tree (a
Slurm job's, which slurmd starts: tests/integration/test_slurm.py shows ~0 here)."""

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

OPTION = "--cpu-times"
TICK = os.sysconf("SC_CLK_TCK")
SHOWN = 30


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, metavar="FILE", help="write each test's CPU seconds (its processes included) to FILE")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children) from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... utime is field 14
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return int(fields[1]), (utime + stime + cutime + cstime) / TICK


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its reaped children and every live process under it."""
    stats = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(int(pid))
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += stats[str(pid)][1]
        todo.extend(children.get(pid, []))
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class CpuTimes:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict] = []
        Path(path).write_text("")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        cpu, wall = tree_cpu_seconds(), time.monotonic()
        yield
        row = {
            "test": item.nodeid,
            "cpu": round(tree_cpu_seconds() - cpu, 2),
            "wall": round(time.monotonic() - wall, 2),
            "outcome": getattr(item, "cpu_time_outcome", "?"),
        }
        self.rows.append(row)
        with open(self.path, "a") as out:
            out.write(json.dumps(row) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Iterator[None]:
        report = (yield).get_result()
        if report.when == "call" or report.outcome != "passed":
            item.cpu_time_outcome = report.outcome

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        rows = sorted(self.rows, key=lambda r: -r["cpu"])
        total = sum(r["cpu"] for r in rows)
        terminalreporter.write_sep("=", f"CPU seconds per test: {total:.0f} s in all, the {SHOWN} costliest")
        for r in rows[:SHOWN]:
            terminalreporter.write_line(f"{r['cpu']:8.1f} cpu {r['wall']:8.1f} wall  {r['test']}")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(OPTION)
    if path:
        config.pluginmanager.register(CpuTimes(path), "cpu_times")
