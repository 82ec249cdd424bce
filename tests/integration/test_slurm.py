"""The emitted sbatch script (meshlm/plan/emit.py) on a real Slurm: slurmctld, slurmd and munge from Debian's
`slurm-wlm` on this machine (tests/slurm_cluster.py), the job submitted with `sbatch` as the planner wrote it.

- the time limit: Slurm's own warning (`--signal=TERM@G`, G from the plan's grace) reaches the step's tasks,
  the run saves, `meshlm launch` exits 0, the script requeues the job, which resumes and trains to the end;
- `scancel --signal=TERM JOB` (a site's preemption notice): the same save, exit 0 and requeue;
- a killed worker (MESHLM_INJECT_FAULT kill): the agent restarts the group in place, the job completes with no
  requeue, and the steps it redoes have the same losses;
- a SIGTERM to the batch shell alone (`scancel --batch --signal=TERM`) after that job trained to its last step
  and committed it, while its agent is still in teardown: the script passes it on, the agent has nothing to
  save, and the finished job is not requeued (the script once requeued it for one more allocation);
and the three jobs' loss curves, interrupted at different steps, are identical at every step.

So that a 24-step run is still training when the warning comes (Slurm checks time limits every 30 s), the test
pauses the workers (SIGSTOP) once they have trained a step, brings the notice, and lets them go on (SIGCONT) as
soon as Slurm's SIGTERM is pending on them (or they are gone: Slurm sends the time limit's warning after a
SIGCONT of its own). `meshlm` is this worktree's CLI, put where the script installs meshlm (MESHLM_VENV
with its install marker), so the script's own pip install is skipped. Every wait polls with a generous bound."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import slurm_cluster
from slurm_cluster import Slurm, wait_for
from test_plan_emit import RUN_TOML, plan_args

from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state
from meshlm.plan.cli import run_plan

pytestmark = pytest.mark.skipif(bool(slurm_cluster.missing()), reason="no Slurm here: apt-get install slurm-wlm munge")

STEPS = 24
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
INSTALL = "meshlm==0.1.0"
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
ROOT = Path(__file__).resolve().parents[2]
PERIODIC_S = 30  # slurmctld's PERIODIC_TIMEOUT: how often it checks time limits


def seconds(duration: str) -> int:
    """Slurm's [D-]HH:MM:SS (`scontrol show job`'s RunTime) in seconds."""
    days, _, clock = duration.rpartition("-")
    hours, minutes, secs = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + secs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Slurm:
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def emit(tmp_path: Path) -> Path:
    """The `test` model planned on 2 cpu ranks of one node, written as an sbatch script."""
    config, calibration, target = tmp_path / "run.toml", tmp_path / "cal.json", tmp_path / "job.sbatch"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 2}))
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration), "--top", "1",
            "--emit", "slurm", "--emit-to", str(target), "--install", INSTALL, "--time-limit", "10m")  # fmt: skip
    assert run_plan(plan_args(*argv)) == 0
    return target


def installed_meshlm(tmp_path: Path) -> Path:
    """MESHLM_VENV as the script leaves it after installing INSTALL, with this worktree's CLI as `meshlm`."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".meshlm-install").write_text(INSTALL + "\n")
    meshlm = venv / "bin" / "meshlm"
    meshlm.write_text(f'#!/bin/sh\nexec {sys.executable} -m meshlm.cli "$@"\n')
    meshlm.chmod(0o755)
    return venv


def submit(slurm: Slurm, tmp_path: Path, data_cache: str, **env: str) -> str:
    script = emit(tmp_path)
    train = ["--data.max_chars", "1500000", "--data.cache_dir", data_cache, "--log.tensorboard", "false",
             "--train.eval_every", "0", "--log.every", "1", "--checkpoint.every", "4", "--train.steps", str(STEPS),
             "--fault.watchdog_s", "120", "--parallel.timeout_s", "60"]  # fmt: skip
    inherited = {k: v for k, v in slurm.env.items() if k != "MESHLM_INJECT_FAULT"}
    job_env = {**inherited, "MESHLM_VENV": str(installed_meshlm(tmp_path)), "MESHLM_RUN_DIR": str(tmp_path / "run"),
               "RDZV_PORT": str(slurm_cluster.free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **env}  # fmt: skip
    cluster = Slurm(slurm.root, job_env)
    return cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", str(script), *train).strip().split(";")[0]


def records(tmp_path: Path) -> list[dict]:
    metrics = tmp_path / "run" / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip().endswith("}")]


def losses(tmp_path: Path) -> dict[int, float]:
    """Each step's loss, from its last attempt."""
    return {r["step"]: r["loss"] for r in records(tmp_path) if r["kind"] == "train"}


def workers(run_dir: Path, agents: bool = False) -> list[int]:
    """The pids of `meshlm train` processes of this run, or (`agents`) of their `meshlm launch` agents (not
    `srun`, whose command line holds the agent's)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        agent = words[1:4] == [b"-m", b"meshlm.cli", b"launch"]
        if b"train" in words and str(run_dir).encode() in words and (agent if agents else b"launch" not in words):
            found.append(int(cmdline.parent.name))
    return found


def sigterm_pending(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: nothing left to hold
    pending = [line.split()[1] for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(int(mask, 16) & SIGTERM_BIT for mask in pending)


def paused_until_sigterm(slurm: Slurm, job: str, tmp_path: Path, notice: Callable[[], object]) -> None:
    """Once both workers have trained a step: pause them, `notice()` (which must make Slurm send SIGTERM), wait
    until it is pending on both, and let them go on to handle it."""
    wait_for("a training step", lambda: any(r["kind"] == "train" for r in records(tmp_path)), timeout=300)
    pids = wait_for("two workers", lambda: p if len(p := workers(tmp_path / "run")) == 2 else None, timeout=60)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        notice()
        wait_for("Slurm's SIGTERM on the workers", lambda: all(sigterm_pending(p) for p in pids), timeout=150)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue


def finished(slurm: Slurm, job: str, timeout: float = 400) -> dict[str, str]:
    try:
        return wait_for(f"job {job} to end", lambda: j if (j := slurm.job(job))["JobState"] in ENDED else None,
                        timeout=timeout)  # fmt: skip
    except AssertionError:
        slurm.run("scancel", job, check=False)
        raise


def output(tmp_path: Path, job: str) -> str:
    return (tmp_path / f"meshlm-run-{job}.out").read_text()


def check_requeued_and_resumed(slurm: Slurm, job: str, tmp_path: Path) -> int:
    """The job saved mid-run, exited 0, requeued itself once and trained to the end: the saved step. Slurm holds
    a requeued job for two minutes (its BeginTime); the test lets it start early, but only once the node has
    cleaned up the first run: slurmd revokes the job's credential when it terminates that run
    (`_rpc_terminate_job`) and refuses a launch whose credential is not newer than the revocation in whole
    seconds (`slurm_cred_revoked`: ctime <= revoked; "Job N already killed, do not launch batch job", the job
    then FAILS). scontrol shows the job PENDING only once the node's terminate is done (job_state_string names
    the COMPLETING and REQUEUED flags first), so a credential made in a later second than that is newer (Slurm
    22.05 src/slurmd/slurmd/req.c, src/common/slurm_cred.c, src/common/slurm_protocol_defs.c)."""
    wait_for("the requeue", lambda: (j := slurm.job(job))["Restarts"] != "0" or j["JobState"] in ENDED, timeout=300)
    wait_for("the first run's clean-up", lambda: slurm.job(job)["JobState"] in ("PENDING", *ENDED), timeout=300)
    cleaned_up = time.time()
    time.sleep(math.floor(cleaned_up) + 1.2 - cleaned_up)  # into the next whole second (same clock as slurmd's)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)  # refused once it runs: fine
    state = finished(slurm, job)
    out = output(tmp_path, job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:], slurm.logs())
    assert state["Restarts"] == "1", (state, out[-3000:])
    saved = int(out.split("SIGTERM: saved step ")[1].split(",")[0])
    assert 0 < saved < STEPS and out.count("SIGTERM: saved step") == 1, out[-3000:]
    assert "every worker stopped cleanly; exiting 0" in out
    assert f"meshlm: stopped by a signal after saving; requeueing job {job}" in out
    assert "SIGTERM to the batch shell" not in out  # Slurm signalled the step's tasks, not the batch shell
    resume = next(r for r in records(tmp_path) if r["kind"] == "resume")
    assert resume["step"] == saved
    final = list_checkpoints(tmp_path / "run")[-1]
    assert read_trainer_state(final)["step"] == STEPS
    return saved


def ended_or_requeued(state: dict[str, str]) -> bool:
    return state["JobState"] in ENDED or state["Restarts"] != "0"


def sigterm_in_teardown(slurm: Slurm, job: str, run_dir: Path, first: list[int]) -> None:
    """Once the agent has restarted the workers (`first`: the first attempt's), pause it, so that the job is
    still in its step when the run has trained to its last step, committed it and its workers have exited;
    then SIGTERM the batch shell alone and let the agent go on once the SIGTERM the script passes on through
    Slurm is pending on it. `scancel --batch` signals "only the batch step, but not any other steps nor any
    children of the shell script" (scancel(1), Slurm 22.05)."""

    def restarted() -> list[int] | None:
        found = workers(run_dir)
        return found if len(found) == 2 and not set(found) & set(first) else None

    def trained_to_the_end() -> bool:
        found = list_checkpoints(run_dir)
        return bool(found) and read_trainer_state(found[-1])["step"] == STEPS

    wait_for("the restarted workers", restarted, timeout=300, every=0.2)
    (agent,) = wait_for("the agent", lambda: workers(run_dir, agents=True), timeout=60)
    os.kill(agent, signal.SIGSTOP)
    try:
        wait_for("the last step's checkpoint", trained_to_the_end, timeout=400)
        wait_for("the workers to exit", lambda: not workers(run_dir), timeout=120)
        slurm.run("scancel", "--batch", "--signal=TERM", job)
        wait_for("the SIGTERM passed on to the agent", lambda: sigterm_pending(agent), timeout=60)
    finally:
        os.kill(agent, signal.SIGCONT)


@pytest.fixture(scope="module")
def killed_job(slurm: Slurm, data_cache: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A job whose rank 1 SIGKILLs itself after step 5 (first attempt only), and whose batch shell alone gets
    a SIGTERM after the run finished (`sigterm_in_teardown`): its directory and id, once it ended or was
    requeued."""
    tmp_path = tmp_path_factory.mktemp("killed")
    job = submit(slurm, tmp_path, data_cache, MESHLM_INJECT_FAULT="1:5:kill")
    first = wait_for("two workers", lambda: p if len(p := workers(tmp_path / "run")) == 2 else None, timeout=300)
    sigterm_in_teardown(slurm, job, tmp_path / "run", first)
    try:
        wait_for(f"job {job} to end or requeue", lambda: ended_or_requeued(slurm.job(job)), timeout=400)
    finally:
        if slurm.job(job)["JobState"] not in ENDED:
            slurm.run("scancel", job, check=False)
    return tmp_path, job


@pytest.mark.slow  # starts the one-machine Slurm: ~20 s
def test_the_node_is_this_machine_and_the_cpu_runs_script_fits_it(slurm: Slurm, tmp_path: Path) -> None:
    """The test node is declared as `slurmd -C` reports this machine (it once claimed 16 CPUs, which hid that a
    CPU run's script asked for 8 per "GPU", 16, and never scheduled on a 2-CPU node); the script of 2 CPU ranks
    on one node, as emitted, asks for 2 CPUs and Slurm finds it a start here (`sbatch --test-only`). The slow
    tests below run it to completion."""
    node = dict(w.split("=", 1) for w in slurm.run("scontrol", "-o", "show", "node").split() if "=" in w)
    assert f"CPUs={node['CPUTot']} " in slurm_cluster.node_hardware() + " "
    script = emit(tmp_path)
    assert "#SBATCH --cpus-per-task=2\n" in script.read_text()
    done = subprocess.run(["sbatch", "--test-only", f"--chdir={tmp_path}", str(script)], env=slurm.env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and " to start at " in done.stderr, done.stderr


@pytest.mark.slow  # a real Slurm job whose worker is killed and restarted in place: ~1 min
def test_a_killed_worker_restarts_in_place_and_the_job_completes(slurm: Slurm, killed_job: tuple[Path, str]) -> None:
    tmp_path, job = killed_job
    state, out = slurm.job(job), output(tmp_path, job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:], slurm.logs())
    assert state["Restarts"] == "0" and "requeueing" not in out, out[-3000:]  # restarted by the agent, in place
    history = records(tmp_path)
    cut = next(i for i, r in enumerate(history) if r["kind"] == "resume")
    before = {r["step"]: r["loss"] for r in history[:cut] if r["kind"] == "train"}
    step = history[cut]["step"]
    assert max(before) == 5 and step in (0, 4), (step, before)  # step 4's async save may not have committed
    after = {r["step"]: r["loss"] for r in history[cut:] if r["kind"] == "train"}
    assert sorted(after) == list(range(step + 1, STEPS + 1))
    assert all(after[s] == before[s] for s in range(step + 1, 6)), (before, after)  # redone steps: same losses
    assert read_trainer_state(list_checkpoints(tmp_path / "run")[-1])["step"] == STEPS


@pytest.mark.slow  # shares the killed worker's job: ~1 min
def test_a_sigterm_to_the_batch_shell_after_the_run_finished_does_not_requeue_it(
    slurm: Slurm, killed_job: tuple[Path, str]
) -> None:
    """The script passes the shell's SIGTERM on to the agent, which says the run had finished, and the job
    completes: it once requeued itself on the shell's SIGTERM alone and trained nothing more for an allocation."""
    tmp_path, job = killed_job
    state, out = slurm.job(job), output(tmp_path, job)
    assert f"meshlm: SIGTERM to the batch shell: passed on to the step's tasks of job {job}" in out, out[-3000:]
    assert "meshlm launch: SIGTERM after the run finished: nothing to save; exiting 0" in out, out[-3000:]
    assert state["Restarts"] == "0" and state["JobState"] == "COMPLETED", (state, out[-3000:], slurm.logs())
    assert not list((tmp_path / "run").glob(".stopped-*"))


@pytest.mark.slow  # a real Slurm job stopped by its time limit's warning, requeued and resumed: ~1-2 min
def test_the_time_limit_warning_saves_exits_0_requeues_and_resumes_to_the_end(
    slurm: Slurm, data_cache: str, tmp_path: Path, killed_job: tuple[Path, str]
) -> None:
    """While the workers are paused, the limit is brought to where Slurm's next check sends the script's
    `--signal=TERM@G`, and restored once the signal is out, so the requeued job runs to the end, on the loss
    curve of the job killed at step 5 (resumed from another step)."""
    job = submit(slurm, tmp_path, data_cache)
    text = (tmp_path / "job.sbatch").read_text()
    warn = int(text.split("#SBATCH --signal=")[1].split()[0].split("@")[1])
    assert warn > PERIODIC_S and "#SBATCH --time=0-00:10:00" in text

    def warn_at_next_check() -> None:
        """The limit, in whole minutes from the job's start, that puts its end between G - 30 s and G + 30 s from
        now. slurmctld checks limits every PERIODIC_TIMEOUT = 30 s (src/slurmctld/controller.c); it sends the
        warning once `now + warn_time + PERIODIC_TIMEOUT >= end_time` (send_job_warn_signal in
        src/slurmctld/job_mgr.c, Slurm 22.05: so at its next check) and kills only once
        `end_time <= now - OverTimeLimit * 60` (job_time_limit), which is at least G - 30 s plus the test
        cluster's OVER_TIME_LIMIT_MIN away, however late the test gets to restore the limit."""
        elapsed = seconds(slurm.job(job)["RunTime"])
        minutes = min((elapsed + warn + PERIODIC_S) // 60, 10)
        slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")

    paused_until_sigterm(slurm, job, tmp_path, warn_at_next_check)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    check_requeued_and_resumed(slurm, job, tmp_path)
    assert losses(tmp_path) == losses(killed_job[0])


@pytest.mark.slow  # a real Slurm job stopped by `scancel --signal=TERM`, requeued and resumed: ~1 min
def test_scancel_sigterm_saves_exits_0_requeues_and_resumes_to_the_end(
    slurm: Slurm, data_cache: str, tmp_path: Path, killed_job: tuple[Path, str]
) -> None:
    """A site's preemption notice: Slurm signals the step's tasks (the agent and its workers) at once."""
    job = submit(slurm, tmp_path, data_cache)
    paused_until_sigterm(slurm, job, tmp_path, lambda: slurm.run("scancel", "--signal=TERM", job))
    check_requeued_and_resumed(slurm, job, tmp_path)
    assert losses(tmp_path) == losses(killed_job[0])
