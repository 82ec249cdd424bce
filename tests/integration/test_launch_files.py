"""The Kubernetes and SkyPilot launch files under their schedulers' own restart rules (meshlm/plan/emit.py,
meshlm/plan/emit_k8s.py, docs/clusters.md "Exit codes"): a run a SIGTERM stops mid-way saves, exits
STOP_EXIT (143), and the scheduler restarts it; it never ends as "succeeded" with steps left.

No Kubernetes cluster or SkyPilot controller runs here, so each scheduler is a stand-in that decides, from a
container's (or a run command's) exit code, what the controller's source decides; each cites the file and
function it reproduces. The command the file writes is run as it is written (the container's `command`, the
task's `run`), on this machine's CPUs, twice: the first attempt is SIGTERMed after step 3
(`MESHLM_INJECT_FAULT`, timed by the run itself), the stand-in reads its exit code, and the second attempt
(the scheduler's restart) resumes from the saved step and trains to the end, after which the stand-in says
the job succeeded. Mutation: without MESHLM_STOP_EXIT in the files (emit's `_pod_spec` env, the task's
`envs`), the first attempt exits 0 and every stand-in calls the job succeeded after step 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import free_port
from test_plan_emit import INSTALL, RUN_TOML, plan_args, shims, typed_round_trip
from test_plan_skypilot import block, parse

from meshlm import launch
from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state
from meshlm.plan.cli import run_plan
from meshlm.plan.emit import RUN_MOUNT, STOP_EXIT, TARGET_SHAPES, Launch, Site, skypilot, slurm
from meshlm.plan.emit_k8s import kubernetes, kubernetes_job
from meshlm.plan.hardware import hardware
from meshlm.plan.spot import Pool

STEPS = 8
STOP_STEP = 3  # the first attempt's SIGTERM, after this step (every process of the "node", as a shutdown sends)
CPU_LAUNCH = Launch("cpu run", 1, 1, 0, 2, 3, ("--model.preset", "test"), gpu=False, summary="s")
SITE = Site("stdlib", install=INSTALL, bucket="s3://b/r")


# ---- the schedulers' rules, from their source -----------------------------------------------------------------


def pytorchjob_after(exit_code: int, restart_policy: str, elastic: bool) -> str:
    """Kubeflow training-operator (release-1.9) on one worker's exit: a worker that exits 0 is Succeeded, and
    with an elasticPolicy one succeeded worker makes the whole PyTorchJob Succeeded
    (pkg/controller.v1/pytorch/pytorchjob_controller.go, UpdateJobStatus: `expected == 0 ||
    (pytorchjob.Spec.ElasticPolicy != nil && succeeded > 0)`). A failed worker is restarted under OnFailure
    or Always (the pod's own restartPolicy; the controller deletes and recreates a Failed pod,
    pkg/controller.v1/common/pod.go, ReconcilePods), and under ExitCode only when the code is retryable
    (pkg/util/train/train_util.go, IsRetryableExitCode: `exitCode >= 128`); otherwise the job fails."""
    if exit_code == 0:
        return "Succeeded" if elastic else "Running"
    if restart_policy in ("OnFailure", "Always") or (restart_policy == "ExitCode" and exit_code >= 128):
        return "Restarting"
    return "Failed"


def job_after(exit_code: int, spec: dict, conditions: tuple[str, ...] = ()) -> str:
    """The Kubernetes Job controller on one indexed pod's end: exit 0 completes its index (the Job is
    Complete once every index has); a failed pod is matched against the podFailurePolicy's rules in order
    (pkg/controller/job/pod_failure_policy.go, matchPodFailurePolicy: onExitCodes matches a terminated
    container with a non-zero code, named or any, by In / NotIn; onPodConditions a condition of that type
    with status True): Ignore replaces the pod without counting it against backoffLimit, FailJob fails the
    Job, Count (or no rule) counts it."""
    if exit_code == 0:
        return "Completed index"
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        if codes := rule.get("onExitCodes"):
            listed = exit_code in codes["values"]
            matched = codes.get("containerName") in (None, "pytorch") and listed == (codes["operator"] == "In")
        else:
            matched = any(p["type"] in conditions and p["status"] == "True" for p in rule["onPodConditions"])
        if matched:
            return {"Ignore": "Replaced, not counted", "FailJob": "Failed", "Count": "Replaced, counted"}[
                rule["action"]
            ]
    return "Replaced, counted"


def skypilot_after(exit_code: int, recovery: dict, cluster_up: bool = True) -> str:
    """SkyPilot's managed-job controller (0.14.1) on the run command's end (sky/jobs/controller.py,
    JobController._monitor_one_task_impl, which reads the job's exit codes for the executor):
    JobStatus SUCCEEDED (exit 0) marks the managed job SUCCEEDED and tears its cluster down; FAILED on a
    cluster no longer UP is a preemption, recovered; FAILED on a cluster still UP is the user program's failure,
    restarted when StrategyExecutor.should_restart_on_failure allows (sky/jobs/recovery_strategy.py): always,
    without counting, for a code in `recover_on_exit_codes`; else while the count stays within
    `max_restarts_on_errors`."""
    if exit_code == 0:
        return "SUCCEEDED"
    if not cluster_up or exit_code in recovery.get("recover_on_exit_codes", []):
        return "RECOVERING, not counted"
    return "RECOVERING, counted" if recovery.get("max_restarts_on_errors", 0) > 0 else "FAILED"


def test_the_stand_ins_follow_their_sources_rules() -> None:
    """The rules the stand-ins encode, on the cases that decide a stopped run's fate."""
    assert pytorchjob_after(0, "OnFailure", elastic=True) == "Succeeded"  # a saved stop at exit 0: steps lost
    assert pytorchjob_after(STOP_EXIT, "OnFailure", elastic=True) == "Restarting"
    assert pytorchjob_after(STOP_EXIT, "ExitCode", elastic=True) == "Restarting"  # >= 128: retryable
    assert pytorchjob_after(1, "ExitCode", elastic=True) == "Failed"
    spec = json.loads(kubernetes_job(CPU_LAUNCH, SITE, "i"))["items"][1]["spec"]
    assert job_after(STOP_EXIT, spec) == "Replaced, not counted"
    assert job_after(137, spec, ("DisruptionTarget",)) == "Replaced, not counted"  # evicted, then SIGKILLed
    assert job_after(1, spec) == "Replaced, counted"
    recovery = parse(skypilot(CPU_LAUNCH, SITE, Pool(1, 1), hardware("cpu")))["resources"]["job_recovery"]
    assert skypilot_after(0, recovery) == "SUCCEEDED"
    assert skypilot_after(STOP_EXIT, recovery) == "RECOVERING, not counted"
    assert skypilot_after(1, recovery) == "RECOVERING, counted"


# ---- the files ------------------------------------------------------------------------------------------------


def test_the_indexed_job_and_its_service_deserialise_into_the_kubernetes_typed_models() -> None:
    """The Service and the Job into the kubernetes client's models and back, nothing dropped or retyped; the
    pods are `NAME-i.NAME` (subdomain = the headless Service), meet at index 0, restart on STOP_EXIT and on
    a disruption without counting, and there are no spares (a Job completes only when every index exits 0)."""
    k8s = pytest.importorskip("kubernetes.client")
    api = k8s.ApiClient()
    manifest = json.loads(kubernetes_job(Launch("m", 4, 2, 0, 8, 5, ("--model.preset", "llama3-8b"), spot=True,
                                                summary="s"), SITE, "registry/meshlm:1"))  # fmt: skip
    service, job = manifest["items"]
    assert manifest["kind"] == "List" and service["kind"] == "Service" and job["kind"] == "Job"
    typed_round_trip(api, service, "V1Service")
    typed_round_trip(api, job, "V1Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"] == "meshlm-m"
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert pod["restartPolicy"] == "Never"  # a podFailurePolicy needs it
    command = pod["containers"][0]["command"]
    assert command[:2] == ["meshlm", "launch"] and "--nnodes=2:4" in command and "--nproc-per-node=8" in command
    assert "--rdzv-endpoint=meshlm-m-0.meshlm-m:29500" in command
    assert {"name": "MESHLM_STOP_EXIT", "value": str(STOP_EXIT)} in pod["containers"][0]["env"]
    assert pod["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert not TARGET_SHAPES["kubernetes-job"].spares


def test_a_cpu_run_asks_each_scheduler_for_the_cpus_it_uses() -> None:
    """Two CPU ranks on a node ask for 2 CPUs (they once asked for 8 per "GPU", 16, which a 2-CPU node never
    schedules); a GPU run keeps 8 per GPU."""
    script = slurm(CPU_LAUNCH, SITE)
    assert "#SBATCH --cpus-per-task=2\n" in script and "srun --kill-on-bad-exit=0 --ntasks-per-node=1 " \
        "--cpus-per-task=2 " in script  # fmt: skip
    for manifest in (json.loads(kubernetes(CPU_LAUNCH, SITE, "i"))["spec"]["pytorchReplicaSpecs"]["Worker"],
                     json.loads(kubernetes_job(CPU_LAUNCH, SITE, "i"))["items"][1]["spec"]):  # fmt: skip
        assert manifest["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "2"}
    assert parse(skypilot(CPU_LAUNCH, SITE, Pool(1, 1), hardware("cpu")))["resources"]["cpus"] == "2+"
    gpu = Launch("gpu run", 1, 1, 0, 8, 3, ())
    assert "#SBATCH --cpus-per-task=64\n" in slurm(gpu, SITE)


def test_every_missing_emit_flag_is_named_in_one_line_and_install_with_kubernetes_is_refused(
    capsys: pytest.CaptureFixture,
) -> None:
    """`plan --emit slurm` without --data-source and --install names both at once (it once named one per
    attempt); --install with a Kubernetes target (which runs --image) is refused instead of ignored."""
    base = ("--model", "test", "--gpu", "cpu", "--gpus", "2")
    assert run_plan(plan_args(*base, "--emit", "slurm")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--emit slurm needs --data-source (" in err and " and --install (" in err, err
    assert run_plan(plan_args(*base, "--emit", "skypilot")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(f"{flag} (" in err for flag in ("--bucket", "--data-source", "--install"))
    for target in ("kubernetes", "kubernetes-job"):
        assert run_plan(plan_args(*base, "--emit", target, "--data-source", "d", "--image", "i", "--install",
                                  INSTALL)) == 2  # fmt: skip
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--emit {target} runs --image" in err and "drop --install" in err, err


def test_the_pytorchjob_check_script_ends_at_once_on_sigterm_while_it_checks(tmp_path: Path) -> None:
    """With --check the container's first process is sh until it execs `meshlm launch`; PID 1 ignores a signal
    it has no handler for, so the kubelet's SIGTERM during the check waited out the grace for a SIGKILL. The
    script now ends at once with one line and STOP_EXIT (the pod restarts and checks again)."""
    job = json.loads(kubernetes(CPU_LAUNCH, Site("stdlib", check=True), "i"))
    sh, _, script = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "check-started"
    (bin_dir / "meshlm").write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 300\n")  # a check that takes long
    (bin_dir / "meshlm").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PET_RDZV_ENDPOINT": "w0:1", "HOSTNAME": "w0", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sh, "-c", script.replace(RUN_MOUNT, str(tmp_path / "claim"))], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:  # the check runs
            time.sleep(0.05)
        assert started.exists()
        proc.send_signal(signal.SIGTERM)  # the shell, as the kubelet signals the container's first process
        _, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the check's stand-in, left in the shell's process group
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == STOP_EXIT, err
    assert err == "meshlm: stopped by a signal during meshlm check: nothing trained, nothing to save\n"


# ---- a SIGTERM mid-run under each file, and its scheduler's verdict -------------------------------------------


def _plan_cpu_file(tmp_path: Path, target: str, *extra: str) -> Path:
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 2}))
    path = tmp_path / f"file.{target}"
    assert run_plan(plan_args("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration),
                              "--top", "1", "--emit", target, "--emit-to", str(path), *extra)) == 0  # fmt: skip
    return path


def _train(data_cache: str) -> list[str]:
    return ["--train.steps", str(STEPS), "--checkpoint.every", "2", "--data.max_chars", "1500000",
            "--data.cache_dir", data_cache, "--log.progress", "false", "--log.tensorboard", "false",
            "--train.eval_every", "0", "--log.every", "1", "--fault.watchdog_s", "60",
            "--parallel.timeout_s", "60"]  # fmt: skip


def _attempt(command: list[str], env: dict[str, str], fault: str = "") -> tuple[int, str]:
    proc = subprocess.Popen(command, env=env | {"MESHLM_INJECT_FAULT": fault}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out = proc.communicate(timeout=300)[0]  # a few seconds of training; torch's import on a loaded machine
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{command[:3]} did not finish within 300 s") from None
    return proc.returncode, out


def _stopped_then_resumed(run_dir: Path, command: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Two attempts of the file's command: SIGTERM after step STOP_STEP, then the restart. Their exit codes."""
    first, out = _attempt(command, env, fault=f"0:{STOP_STEP}:sigterm-all")
    saved = read_trainer_state(list_checkpoints(run_dir)[-1])["step"]
    assert saved == STOP_STEP and f"SIGTERM: saved step {STOP_STEP}, exiting" in out, out[-3000:]
    second, out = _attempt(command, env)
    assert f"resuming from {run_dir}" in out and second == 0, out[-3000:]
    assert read_trainer_state(list_checkpoints(run_dir)[-1])["step"] == STEPS
    return first, second


def _container_env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["containers"][0]["env"]}


@pytest.mark.slow  # two attempts of a 2-rank `meshlm launch`: ~40 s on 2 cores
@pytest.mark.parametrize("target", ["kubernetes", "kubernetes-job"])
def test_sigterm_mid_run_restarts_under_kubernetes_rules(data_cache: str, tmp_path: Path, target: str) -> None:
    """The container's command as written (its env too), one pod of 2 CPU ranks: the PyTorchJob's agent gets
    the rendezvous from the operator's PET_* variables, the Job's names `NAME-0.NAME` (here: this machine)."""
    manifest = json.loads(_plan_cpu_file(tmp_path, target, "--image", "i", "--data-source", "stdlib").read_text())
    run_dir = tmp_path / "run"
    venv = shims(tmp_path)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    port = free_port()
    if target == "kubernetes":
        pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        env |= {"PET_NNODES": "1:1", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
                "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_ID": "k8s-test",
                "PET_MAX_RESTARTS": "3"}  # fmt: skip
    else:
        spec = manifest["items"][1]["spec"]
        pod = spec["template"]["spec"]
        env |= {"JOB_COMPLETION_INDEX": "0"}
    written = pod["containers"][0]["command"]
    command = []  # the claim's paths here; the Job's rendezvous name (DNS of its Service) this machine
    for before, word in zip(["", *written], written, strict=False):
        if word.startswith(RUN_MOUNT):
            word = str(run_dir) if before == "--log.run_dir" else word.replace(RUN_MOUNT, str(tmp_path / "claim"))
        command.append(word.replace(f"{pod.get('subdomain')}-0.{pod.get('subdomain')}:29500", f"127.0.0.1:{port}"))
    command = [*command, *_train(data_cache)]
    first, second = _stopped_then_resumed(run_dir, command, env | _container_env(pod))
    assert first == STOP_EXIT
    if target == "kubernetes":
        policy = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"]
        assert pytorchjob_after(first, policy, elastic="elasticPolicy" in manifest["spec"]) == "Restarting"
        assert pytorchjob_after(second, policy, elastic=True) == "Succeeded"
    else:
        assert job_after(first, spec) == "Replaced, not counted"
        assert job_after(second, spec) == "Completed index"


@pytest.mark.slow  # two attempts of a 2-rank `meshlm launch`: ~40 s on 2 cores
def test_sigterm_mid_run_recovers_under_skypilot_rules(data_cache: str, tmp_path: Path) -> None:
    """The task's `run` as written, with its `envs` and SkyPilot's node variables, on one node of 2 CPU ranks:
    a node shutdown's SIGTERM to every process saves, the run command exits STOP_EXIT (exec: the agent's
    code, not a shell's), and the controller recovers it without counting it as a user error."""
    task = parse(_plan_cpu_file(tmp_path, "skypilot", "--bucket", "s3://b/r", "--install", INSTALL,
                                "--data-source", "stdlib").read_text())  # fmt: skip
    run = tmp_path / "run.sh"
    run.write_text(task["run"])
    assert block(_plan_cpu_file(tmp_path, "skypilot", "--bucket", "s3://b/r", "--install", INSTALL,
                                "--data-source", "stdlib").read_text(), "run") == task["run"]  # fmt: skip
    run_dir = tmp_path / "run"
    venv = shims(tmp_path)
    env = {**os.environ, **{k: str(v) for k, v in task["envs"].items()},
           "PATH": f"{venv / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "2", "MESHLM_RUN_DIR": str(run_dir), "MESHLM_PORT": str(free_port()),
           "MESHLM_CACHE_DIR": data_cache, "MESHLM_TRAIN_ARGS": " ".join(_train(data_cache))}  # fmt: skip
    first, second = _stopped_then_resumed(run_dir, ["bash", str(run)], env)
    recovery = task["resources"]["job_recovery"]
    assert first == STOP_EXIT and skypilot_after(first, recovery) == "RECOVERING, not counted"
    assert skypilot_after(second, recovery) == "SUCCEEDED"


def test_the_files_stop_code_is_the_launchers() -> None:
    """emit (the plan package, which may not import launch) asks for the code launch exits with when a worker did
    not stop cleanly, so a scheduler treats both alike (restarts them)."""
    assert STOP_EXIT == launch.SIGTERM_EXIT
