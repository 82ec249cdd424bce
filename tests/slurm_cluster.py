"""A real one-machine Slurm for the tests: munged, slurmctld and slurmd (Debian's `slurm-wlm` and `munge`) started
in a temporary directory with their own key, ports, state and spool, one node (this host) and one partition.
Only the processes started here are stopped at the end, by the pids they wrote.

The node is declared as `slurmd -C` reports this machine (its CPUs, sockets, cores, threads and memory), as a
site's slurm.conf declares its nodes, so an emitted script that asks for more than the machine has (a CPU run
once asked for 16 CPUs) stays pending here as it would on a real 2-CPU node. The daemons and the jobs run as
the user running the tests.

`OverTimeLimit=OVER_TIME_LIMIT_MIN` makes a job's time limit soft by that many minutes (slurm.conf(5): "Adding
the OverTimeLimit value to the soft time limit provides a hard time limit, at which point the job is
canceled"); Slurm still sends `--signal`'s warning relative to the soft limit (src/slurmctld/job_mgr.c,
send_job_warn_signal, compares warn_time with the job's end_time, not with the end plus OverTimeLimit). A
test that brings a time limit close can so see the warning without racing the kill.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from distributed import free_port

T = TypeVar("T")
OVER_TIME_LIMIT_MIN = 10
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")
CONF = """ClusterName=meshlmtest
SlurmctldHost={host}
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=60
OverTimeLimit={over_time_limit}
MinJobAge=3600
NodeName={host} {hardware} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def node_hardware() -> str:
    """This machine as `slurmd -C` reports it: `CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2
    ThreadsPerCore=1 RealMemory=24105` (its NodeName and UpTime left out)."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()[
        0
    ]
    return " ".join(word for word in line.split() if not word.startswith(("NodeName=", "UpTime=")))


def missing() -> list[str]:
    """The Slurm and munge programs not on PATH (`apt-get install slurm-wlm munge`)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def wait_for(what: str, ready: Callable[[], T], timeout: float = 120, every: float = 0.5) -> T:
    """Poll `ready()` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s KEY=VALUE fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            try:
                wait_for(f"{name} to stop", lambda pid=pid: not Path(f"/proc/{pid}").exists(), timeout=30, every=0.2)
            except AssertionError:
                os.kill(pid, signal.SIGKILL)


def start(root: Path) -> Slurm:
    """munged, slurmctld and slurmd under `root`; returns once the node takes jobs."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=host, user=getpass.getuser(), root=root, ctld_port=free_port(),
                                slurmd_port=free_port(), over_time_limit=OVER_TIME_LIMIT_MIN,
                                hardware=node_hardware()))  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[name]  # a test run inside a Slurm job must not leak that job's settings into these
    cluster = Slurm(root, env)
    subprocess.run(["munged", "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
                    f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munged.seed"], env=env, check=True, timeout=60)  # fmt: skip
    try:
        subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=60)
        subprocess.run(["slurmd"], env=env, check=True, timeout=60)
        wait_for("the Slurm node to be idle", lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%T", check=False))
    except (subprocess.SubprocessError, AssertionError) as e:
        logs = cluster.logs()
        cluster.stop()
        raise AssertionError(f"Slurm did not start: {e}\n{logs}") from None
    return cluster
