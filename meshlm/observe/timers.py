"""The step timers, under the name a user's own strategy code imports them by (see docs/observability.md).
They live in meshlm.parallel.timers, beside the strategies that wrap their waits in them: parallel sits below
observe in meshlm's layers (tests/unit/test_layers.py)."""

from meshlm.parallel.timers import TIMERS, Timers, bubble, comm, data_wait, timed_wait

__all__ = ["TIMERS", "Timers", "bubble", "comm", "data_wait", "timed_wait"]
