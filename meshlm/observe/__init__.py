"""meshlm.observe: what a run did and what the cluster can do.

- timers: spans strategy code puts around its blocking waits (exposed communication, bubble, data wait);
- step: StepObserver turns a step into its time breakdown, tokens/s, MFU and memory;
- aggregate: every rank's metrics side by side, and the straggler;
- doctor: `meshlm doctor`, link bandwidth and matmul speed per rank, the planner's calibration;
- report: `meshlm report RUN_DIR`, a self-contained HTML page of a run.

Metric definitions: docs/observability.md.

The names below are imported on first use (all but `aggregate` and `summarize`, whose module needs no torch
and shares the function's name): `meshlm plan` and `meshlm report` read constants from these modules and
start without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.lazy import lazy_attributes
from meshlm.observe.aggregate import aggregate, summarize  # eager: the module has the function's name

if TYPE_CHECKING:
    from meshlm.observe.memory import ActivationMeter, MemoryProbe, tensor_bytes
    from meshlm.observe.peak import peak_flops
    from meshlm.observe.step import StepObserver, breakdown, mfu
    from meshlm.parallel.timers import TIMERS, Timers, bubble, comm, data_wait, timed_wait

__all__ = [
    "TIMERS",
    "ActivationMeter",
    "MemoryProbe",
    "StepObserver",
    "Timers",
    "aggregate",
    "breakdown",
    "bubble",
    "comm",
    "data_wait",
    "mfu",
    "peak_flops",
    "summarize",
    "tensor_bytes",
    "timed_wait",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(("ActivationMeter", "MemoryProbe", "tensor_bytes"), "meshlm.observe.memory"),
        "peak_flops": "meshlm.observe.peak",
        **dict.fromkeys(("StepObserver", "breakdown", "mfu"), "meshlm.observe.step"),
        **dict.fromkeys(("TIMERS", "Timers", "bubble", "comm", "data_wait", "timed_wait"), "meshlm.parallel.timers"),
    },
)
