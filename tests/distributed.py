"""Run a function on N gloo ranks on localhost and collect each rank's return value (meshlm.testing).

Each test runs many checks inside one process group. `run_shared` reuses one group per world size for the
whole session (spawning, importing and rendezvous cost more than most checks); `run_distributed` spawns a
fresh group, for checks that kill, hang or time out ranks. Every rank has a collective timeout and the caller
kills the group after `timeout` seconds, so a hang fails the test instead of CI.
"""

from meshlm.testing import close_shared_groups, free_port, run_distributed, run_shared

__all__ = ["close_shared_groups", "free_port", "run_distributed", "run_shared"]
