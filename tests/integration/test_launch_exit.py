"""`meshlm launch` ends without the interpreter's teardown (meshlm/launch.py, `exit_now`), so what reaches it
after its run finished cannot change its exit code.

Under Slurm the batch shell's SIGTERM, passed on to the step's tasks in teardown, once ended a finished job as
FAILED: the launcher said "SIGTERM after the run finished: nothing to save; exiting 0" and then aborted
("terminate called without an active exception", srun: task 0: Aborted). The interpreter's teardown (seconds on
a loaded machine, with torch imported) had two ways to turn a finished run into a failure, each shown here
deterministically, with nothing left to timing:

- a signal during the teardown: the interpreter has put back the default handlers by then, so the scheduler's
  SIGTERM kills the launcher (exit -15);
- a daemon thread inside a store call (C++, the GIL released) when the teardown begins: as it takes the GIL back
  the interpreter ends it with `pthread_exit`, whose unwinding through C++ frames aborts the process (exit -6,
  "terminate called without an active exception"). torchrun's rendezvous keep-alive is such a thread, a
  heartbeat every 5 s while its handler lives (after a signal `launch_agent` does not shut the rendezvous
  down).

The launcher runs in a small driver (the CLI's own `main`, with hooks that only wait): the driver marks the
start of the teardown proper (a module global's `__del__`, after the default handlers are back) and waits
there; the "heartbeat" case also starts, before the launcher, a daemon thread that waits in a TCPStore call,
as the keep-alive's heartbeat does, and lets it return there.

Mutation: `meshlm.launch.main` returning `_run(argv)` to the CLI's `sys.exit` instead of `exit_now(...)` (as on
main before this test): the first case exits -15, the second -6 with that line (seen, every run); with
`exit_now` both exit 0 before any teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FINISHED_LINE = "meshlm launch: SIGTERM after the run finished: nothing to save; exiting 0"

WORKER = """
import os, signal
from meshlm import launch

launch.worker_started()
launch.report_stopped(finished=True)
if os.environ.get("STOP_AGENT"):
    os.kill(os.getppid(), signal.SIGSTOP)  # the agent has not seen this worker exit when the SIGTERM comes
"""

# argv: the directory for the marks, "signal" or "heartbeat", then the CLI's arguments
DRIVER = """
import os, sys, threading, time

HERE, CASE = sys.argv[1], sys.argv[2]


class Teardown:
    # a module global: deleted in the teardown proper, after the interpreter put back the default signal
    # handlers and stopped giving the GIL to other threads
    release = None

    def __del__(self, here=HERE, os=os, time=time):
        os.close(os.open(os.path.join(here, "teardown"), os.O_CREAT | os.O_WRONLY))
        if self.release:
            self.release()
        time.sleep(30)  # the test acts meanwhile; without the fix the process ends here


TEARDOWN = Teardown()
if CASE == "heartbeat":  # a daemon thread inside a store call (C++) until the teardown lets it return
    from datetime import timedelta
    from torch.distributed import TCPStore

    STORE = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    CLIENT = TCPStore("127.0.0.1", STORE.port, is_master=False, timeout=timedelta(seconds=600))
    threading.Thread(target=STORE.wait, args=(["teardown"],), daemon=True).start()
    TEARDOWN.release = lambda client=CLIENT: client.set("teardown", "1")
from meshlm.cli import main

sys.exit(main(sys.argv[3:]))
"""


def _launcher(tmp_path: Path, case: str, stop_agent: bool) -> subprocess.Popen:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "driver.py").write_text(DRIVER)
    command = [sys.executable, str(tmp_path / "driver.py"), str(tmp_path), case, "launch", "--standalone",
               "--nproc-per-node=1", str(tmp_path / "worker.py")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STOP_AGENT": "1" if stop_agent else ""}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stopped(pid: int) -> bool:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2] == "T"


def _until(what: str, done, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Wait for `done()` while the launcher runs; generous: a launcher imports torch (seconds under load)."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            return
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.02)


def _end(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sigterm_in_the_teardown_after_a_finished_run_does_not_kill_the_launcher(tmp_path: Path) -> None:
    """The run finishes and the launcher returns 0; a SIGTERM at the start of its teardown (where the
    interpreter's default handler would end it with -15) finds no teardown: it has exited 0."""
    proc = _launcher(tmp_path, "signal", stop_agent=False)
    _until("the launcher's teardown", (tmp_path / "teardown").exists, proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    err = _end(proc)
    assert proc.returncode == 0, err[-3000:]


def test_a_sigterm_after_the_run_finished_exits_0_with_a_heartbeat_in_a_store_call(tmp_path: Path) -> None:
    """As in the Slurm job: the worker finishes, the SIGTERM comes before the agent saw it (torchrun's agent
    leaves through its SignalException path), the launcher says the run had finished and exits 0, though a
    daemon thread is inside a store call when its work is done."""
    proc = _launcher(tmp_path, "heartbeat", stop_agent=True)
    _until("the worker to stop its agent", lambda: _stopped(proc.pid), proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    err = _end(proc)
    assert proc.returncode == 0, err[-3000:]
    assert err.strip().splitlines()[-1] == FINISHED_LINE, err[-3000:]
    assert "terminate called" not in err, err[-3000:]
