"""Where a rank is blocked: strategy code wraps its own waits in these spans so a step can be split into
compute, exposed communication, pipeline bubble and data wait.

    with comm("all_reduce"):          # a synchronous collective, or
        dist.all_reduce(t, group=g)
    timed_wait(work, "reduce_scatter")  # the wait() of an asynchronous one
    with bubble():                    # a pipeline stage idle on a receive
        work.wait()

Only time spent *blocked* counts: an async collective that finishes while the rank computes costs nothing
here, which is exactly "exposed" communication. Spans do not nest: inside an open span, inner spans are
ignored, so no second is counted twice and the parts never exceed the step.

Clocks: on CPU `time.perf_counter`. With `cuda=True` communication and bubble spans record a pair of CUDA
events on the current stream instead: NCCL's `wait()` returns at once on the host and makes the stream wait,
so the elapsed time between the events is the time the compute stream stalled. Events are read (one
synchronisation) when the step ends. Data-wait spans always use the host clock: the sampler is host work.

Disabled (the default) every span is one shared no-op context manager: one attribute test per call.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

_NULL = contextlib.nullcontext()


class Timers:
    """Per-process totals of blocked seconds by key ('comm/all_reduce', 'bubble', 'data_wait')."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.enabled = False
        self.cuda = False
        self.totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []
        self._open = 0

    def enable(self, cuda: bool = False) -> None:
        self.enabled, self.cuda = True, cuda

    def disable(self) -> None:
        self.enabled = False
        self.take()

    def span(self, key: str, device: bool = True) -> contextlib.AbstractContextManager:
        """Time a blocking region under `key`; `device=False` forces the host clock (data wait)."""
        if not self.enabled or self._open:
            return _NULL
        if device and self.cuda:
            return self._cuda_span(key)
        return self._host_span(key)

    @contextlib.contextmanager
    def _host_span(self, key: str) -> Iterator[None]:
        self._open += 1
        start = self.clock()
        try:
            yield
        finally:
            self.totals[key] += self.clock() - start
            self._open -= 1

    @contextlib.contextmanager
    def _cuda_span(self, key: str) -> Iterator[None]:
        self._open += 1
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((key, start, end))
            self._open -= 1

    def take(self) -> dict[str, float]:
        """Return the totals since the last take (reading pending CUDA events) and start again from zero."""
        for key, start, end in self._events:
            end.synchronize()
            self.totals[key] += start.elapsed_time(end) / 1e3
        totals = dict(self.totals)
        self.totals.clear()
        self._events.clear()
        return totals


TIMERS = Timers()


def comm(kind: str) -> contextlib.AbstractContextManager:
    """Blocked on a collective of `kind`: all_reduce, reduce_scatter, all_gather, broadcast, p2p, ..."""
    return TIMERS.span("comm/" + kind) if TIMERS.enabled else _NULL


def bubble() -> contextlib.AbstractContextManager:
    """A pipeline stage idle, waiting for a neighbour's activation or gradient."""
    return TIMERS.span("bubble")


def data_wait() -> contextlib.AbstractContextManager:
    """Waiting for the next batch (host clock)."""
    return TIMERS.span("data_wait", device=False)


def timed_wait(work: Any, kind: str) -> Any:
    """`work.wait()` counted as exposed communication of `kind`; returns what wait() returns."""
    with comm(kind):
        return work.wait()
