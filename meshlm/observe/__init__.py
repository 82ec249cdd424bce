"""meshlm.observe: what a run did and what the cluster can do.

- timers: spans strategy code puts around its blocking waits (exposed communication, bubble, data wait);
- step: StepObserver turns a step into its time breakdown, tokens/s, MFU and memory;
- aggregate: every rank's metrics side by side, and the straggler;
- doctor: `meshlm doctor`, link bandwidth and matmul speed per rank, the planner's calibration;
- report: `meshlm report RUN_DIR`, a self-contained HTML page of a run.

Metric definitions: docs/observability.md.
"""

from meshlm.observe.aggregate import aggregate, summarize
from meshlm.observe.memory import ActivationMeter, MemoryProbe, tensor_bytes
from meshlm.observe.peak import peak_flops
from meshlm.observe.step import StepObserver, breakdown, mfu
from meshlm.observe.timers import TIMERS, Timers, bubble, comm, data_wait, timed_wait

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
