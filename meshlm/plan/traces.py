"""Spot capacity traces: how many spot nodes a pool can hold over time, read from a file or drawn from a
Poisson process, for `meshlm.plan.replay`.

Two file formats:

- **spot-traces** (github.com/skypilot-org/spot-traces, Wu et al., NSDI 2024): JSON
  `{"metadata": {"gap_seconds": 300}, "data": [4, 4, 3, ...]}`, the number of spot nodes up at each tick,
  of a pool of `metadata.nodes` (default: the most ever up) that was kept running while it was recorded.
- **CSV** of events on a pool of N nodes: a comment `# nodes: N`, a header `time_s,lost,regained`, then one
  row per change (seconds since the start, nodes preempted, nodes back). The pool starts with all N up; the
  last row's time is the trace's length (a `T,0,0` row ends a quiet tail).

Either way a trace is the capacity of its own N-node pool over time, so its preemption rate (nodes lost per
node-hour up, `Trace.fitted`) is the trace's own, whatever pool replays it. A pool of S ≤ N slots holds
min(S, capacity) nodes, and every node the trace loses is one of the pool's live ones with probability
(pool's live)/(trace's live) (`meshlm.plan.replay` draws it): a small pool is hit at the trace's per-node
rate, not only when capacity falls below S. A pool of S > N slots sees an events trace's capacity scaled by
S/N; an absolute trace never hosts more than its most nodes up (it cannot say more capacity existed).
A trace is replayed cyclically (a run longer than the trace wraps around to its start).
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import random
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

FORMATS = ("auto", "spot-traces", "csv")
CSV_HEADER = ("time_s", "lost", "regained")


class TraceError(ValueError):
    """A trace file that cannot be read, in one line naming the file and what is valid."""


@dataclass(frozen=True)
class Trace:
    """Piecewise-constant spot capacity of a pool of `nodes` nodes: `values[i]` holds from `times[i]` until
    `times[i + 1]` (the last until `duration_s`). Absolute traces count nodes up; relative ones count nodes
    down from all `nodes` up. `nodes` 0: the most ever up (absolute), the replaying pool's slots (relative;
    `fitted` then takes the most ever down as the size)."""

    times: tuple[float, ...]
    values: tuple[int, ...]
    duration_s: float
    relative: bool
    source: str = "trace"
    nodes: int = 0
    _lives: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _caps: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def size(self, slots: int = 0) -> int:
        """The nodes of the pool the trace was recorded on (`slots`: the replaying pool's, for a relative trace
        of unknown size)."""
        if self.nodes:
            return self.nodes
        return max(1, slots or self.peak) if self.relative else self.peak

    @cached_property
    def peak(self) -> int:
        """The largest value the trace reads."""
        return max(self.values)

    def up(self, value: int, slots: int = 0) -> int:
        """Nodes of the trace's own pool up while it reads `value`."""
        return max(0, self.size(slots) - value) if self.relative else min(value, self.size())

    def live(self, value: int, slots: int) -> int:
        """Nodes up while the trace reads `value`, seen by a pool of `slots`: scaled by slots/size for a larger
        pool on an events trace, else as they are (min(up, slots) is what the pool holds)."""
        n, up = self.size(slots), self.up(value, slots)
        return up * slots // n if self.relative and slots > n else up

    def capacity(self, slots: int) -> tuple[int, ...]:
        """`live` of every piece for a pool of `slots` (before the pool's own min)."""
        if slots not in self._caps:
            self._caps[slots] = tuple(self.live(v, slots) for v in self.values)
        return self._caps[slots]

    def lives(self, slots: int) -> tuple[int, ...]:
        """`live` of every piece for `slots`, computed once per pool size (each replayed run reads it)."""
        if slots not in self._lives:
            self._lives[slots] = tuple(min(c, slots) for c in self.capacity(slots))
        return self._lives[slots]

    @cached_property
    def ends(self) -> tuple[float, ...]:
        """When each piece ends: the next piece's start, and `duration_s` for the last."""
        return (*self.times[1:], self.duration_s)

    def most(self, slots: int) -> int:
        """The most spot nodes of `slots` that are ever up together."""
        return max(self.lives(slots))

    def fitted(self) -> tuple[float, float]:
        """The closed form's inputs as this trace shows them on its own pool: preemptions per node-hour up
        (nodes lost / node-hours up) and the mean time a lost node stays away (node-seconds down / nodes
        back); (0, 0) where nothing is ever lost, inf where nothing comes back. Independent of the pool that
        replays it."""
        slots = self.size()
        lost = back = 0
        up_s = down_s = 0.0
        lives = tuple(self.up(v) for v in self.values)
        for i, (live, start, end) in enumerate(zip(lives, self.times, self.ends, strict=True)):
            up_s += live * (end - start)
            down_s += (slots - live) * (end - start)
            if i:
                change = live - lives[i - 1]
                lost, back = lost + max(0, -change), back + max(0, change)
        rate = lost / (up_s / 3600) if up_s else math.inf
        return rate, (down_s / back if back else (math.inf if lost else 0.0))

    def index(self, t: float) -> int:
        """The piece holding time `t` (0 ≤ t < duration_s)."""
        return bisect.bisect_right(self.times, t) - 1


def _fail(path: Path, what: str) -> TraceError:
    return TraceError(f"spot trace {path}: {what}")


def _spot_traces(path: Path, text: str) -> Trace:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"not JSON ({e.msg}, line {e.lineno}); a spot-traces file is "
                          '{"metadata": {"gap_seconds": N}, "data": [counts]}') from None  # fmt: skip
    gap = doc.get("metadata", {}).get("gap_seconds") if isinstance(doc, dict) else None
    if not isinstance(gap, int | float) or isinstance(gap, bool) or gap <= 0:
        raise _fail(path, "metadata.gap_seconds must be a number > 0 (seconds between two ticks)")
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise _fail(path, "data must be a non-empty list of node counts, one per tick")
    for i, v in enumerate(data):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _fail(path, f"data[{i}] is {v!r}: every tick must be a count of nodes up (an integer ≥ 0)")
    nodes = doc.get("metadata", {}).get("nodes", 0)
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 0 or (nodes and nodes < max(data)):
        raise _fail(path, f"metadata.nodes is {nodes!r}: the pool's size, an integer ≥ the most nodes up "
                          f"({max(data)}), or left out")  # fmt: skip
    if not nodes and not max(data):
        raise _fail(path, "data is all 0 and metadata.nodes is missing: the trace's pool size is unknown")
    return Trace(tuple(i * float(gap) for i in range(len(data))), tuple(data), len(data) * float(gap), False,
                 path.name, nodes)  # fmt: skip


def _csv(path: Path, text: str) -> Trace:
    declared = [line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("# nodes:")]
    if len(declared) != 1 or not declared[0].isdigit() or int(declared[0]) < 1:
        raise _fail(path, "needs one comment line '# nodes: N' (N ≥ 1: the size of the pool the events hit), so "
                          "its preemption rate is per node-hour of the trace itself")  # fmt: skip
    nodes = int(declared[0])
    rows = [r for r in csv.reader(text.splitlines()) if r and not r[0].startswith("#")]
    if not rows or tuple(c.strip() for c in rows[0]) != CSV_HEADER:
        raise _fail(path, f"the first row must be the header {','.join(CSV_HEADER)}")
    times, values, down, last = [0.0], [0], 0, 0.0
    for n, row in enumerate(rows[1:], 2):
        try:
            t, lost, back = float(row[0]), int(row[1]), int(row[2])
        except (ValueError, IndexError):
            raise _fail(path, f"row {n} {','.join(row)!r}: expected time_s (seconds), lost and regained "
                              "(integers)") from None  # fmt: skip
        if t < last or lost < 0 or back < 0:
            raise _fail(path, f"row {n}: times must not decrease and lost/regained must be ≥ 0")
        down = down + lost - back
        if down < 0:
            raise _fail(path, f"row {n}: more nodes regained than were lost (the pool starts with all up)")
        if down > nodes:
            raise _fail(path, f"row {n}: {down} nodes down, more than the trace's '# nodes: {nodes}'")
        if t == times[-1]:
            values[-1] = down
        else:
            times.append(t)
            values.append(down)
        last = t
    if last <= 0:
        raise _fail(path, "needs at least one row with time_s > 0 (the last row's time is the trace's length)")
    times.pop(), values.pop()  # the last row only marks the end
    return Trace(tuple(times), tuple(values), last, True, path.name, nodes)


def load_trace(path: Path, fmt: str = "auto") -> Trace:
    """Read a spot-traces JSON or an events CSV (`fmt` 'auto' goes by the suffix: .json or .csv)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise TraceError(f"spot trace format {fmt!r} is unknown; valid: {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = {".json": "spot-traces", ".csv": "csv"}.get(path.suffix.lower(), "")
        if not fmt:
            raise _fail(path, "unknown trace format (by its suffix); valid: a spot-traces .json "
                              "(skypilot-org/spot-traces) or a .csv with time_s,lost,regained")  # fmt: skip
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
    return _spot_traces(path, text) if fmt == "spot-traces" else _csv(path, text)


def poisson_trace(
    slots: int, preemption_per_node_hour: float, replace_s: float, duration_s: float, seed: int = 0
) -> Trace:
    """`slots` spot nodes, each preempted at the given rate and back after an exponential time of mean
    `replace_s` (the closed form's model, Poisson preemptions), starting all up; a relative trace."""
    rng = random.Random(seed)
    rate = preemption_per_node_hour / 3600
    events: list[tuple[float, int]] = []
    for _ in range(slots):
        t = rng.expovariate(rate) if rate > 0 else duration_s
        while t < duration_s:
            events.append((t, 1))
            t += rng.expovariate(1 / replace_s)
            if t < duration_s:
                events.append((t, -1))
            t += rng.expovariate(rate)
    times, values, down = [0.0], [0], 0
    for t, change in sorted(events):
        down += change
        times.append(t)
        values.append(down)
    return Trace(tuple(times), tuple(values), duration_s, True, f"poisson({slots}, {preemption_per_node_hour}/h)",
                 slots)  # fmt: skip


def write_csv(trace: Trace, path: Path) -> None:
    """A relative trace as an events CSV (the format `load_trace` reads back)."""
    if not trace.relative:
        raise ValueError("write_csv writes relative traces (nodes down); this one counts nodes up")
    lines = [f"# nodes: {trace.size()}", ",".join(CSV_HEADER)]
    for t, before, after in zip(trace.times[1:], trace.values, trace.values[1:], strict=False):
        lines.append(f"{t:.1f},{max(0, after - before)},{max(0, before - after)}")
    lines.append(f"{trace.duration_s:.1f},0,0")
    Path(path).write_text("\n".join(lines) + "\n")


def write_spot_traces(trace: Trace, slots: int, gap_s: float, path: Path) -> None:
    """A trace sampled every `gap_s` as a spot-traces JSON of `slots` nodes (nodes up at each tick)."""
    ticks = int(trace.duration_s // gap_s)
    data = [min(slots, trace.live(trace.values[trace.index(i * gap_s)], slots)) for i in range(ticks)]
    Path(path).write_text(json.dumps({"metadata": {"gap_seconds": gap_s}, "data": data}) + "\n")
