"""Run a function on N gloo ranks on localhost and collect each rank's return value (meshlm.testing).

Each test runs many checks inside one process group. `run_shared` reuses one group per world size for the
whole session (starting, importing and rendezvous cost more than most checks); `run_distributed` starts a
fresh group, for checks that kill, hang or time out ranks. Every rank has a collective timeout and the caller
kills the group after `timeout` seconds, so a hang fails the test instead of CI.
"""

import os

from meshlm import testing
from meshlm.testing import close_shared_groups, free_port, run_distributed, run_shared, shared_group_alive

# Fork ranks from a clean preloaded server (~0.1 s a group instead of ~2 s of imports per rank on 2 cores);
# MESHLM_TEST_START_METHOD=spawn restores fresh interpreters.
testing.START_METHOD = os.environ.get("MESHLM_TEST_START_METHOD", "forkserver")

__all__ = ["close_shared_groups", "free_port", "run_distributed", "run_shared", "shared_group_alive"]
