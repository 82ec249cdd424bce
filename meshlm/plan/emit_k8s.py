"""The Kubernetes launch files of a plan (meshlm/plan/emit.py has the others and what they share): a Kubeflow
training-operator PyTorchJob, and a plain indexed Job with its headless Service for clusters without the
operator. Both run `meshlm launch` as the container's first process (or exec it after --check), with
MESHLM_STOP_EXIT so a run a signal stopped with steps left never ends as "succeeded"."""

from __future__ import annotations

import json
import math
import shlex

from meshlm.plan.emit import (
    JOIN_TIMEOUT_S,
    RDZV_PORT,
    RUN_MOUNT,
    SHM_GB_PER_GPU,
    STOP_EXIT,
    TEARDOWN_S,
    Launch,
    Site,
    check_args,
    job_name,
    node_cpus,
)


def _pod_spec(launch: Launch, site: Site, image: str, command: list[str], restart: str = "") -> dict[str, object]:
    """The worker pod of both Kubernetes files: the claim `site.pvc` (run directory and token cache), a
    memory-backed /dev/shm, terminationGracePeriodSeconds above fault.grace_s for the SIGTERM save,
    MESHLM_STOP_EXIT (a stopped run with steps left does not exit 0), spot nodes on a spot pool."""
    shm = f"{SHM_GB_PER_GPU * max(1, launch.nproc_per_node)}Gi"
    limits = {"nvidia.com/gpu": str(launch.nproc_per_node)} if launch.gpu else {}  # quantities are strings
    env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
           {"name": "MESHLM_STOP_EXIT", "value": str(STOP_EXIT)}]  # fmt: skip
    pod: dict[str, object] = {
        "terminationGracePeriodSeconds": math.ceil(launch.grace_s + TEARDOWN_S),
        "containers": [
            {
                "name": "pytorch",
                "image": image,
                "command": command,
                "env": env,
                "resources": {"limits": limits | {"cpu": str(node_cpus(launch, site.cpus_per_gpu))}},
                "volumeMounts": [{"name": "run", "mountPath": RUN_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
            }
        ],
        "volumes": [
            {"name": "run", "persistentVolumeClaim": {"claimName": site.pvc}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        ],
    }
    if restart:
        pod["restartPolicy"] = restart
    if launch.spot:
        key, _, value = site.spot_selector.partition("=")
        pod["nodeSelector"] = {key: value}
        pod["tolerations"] = [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]
    return pod


def _train_command(launch: Launch, site: Site, agent: list[str], image: str, run_dir: str, first: str) -> list[str]:
    """The container's command: `meshlm launch AGENT -m meshlm.cli train ...` as its first process, or with
    --check a POSIX sh script that checks first (on the worker `first` says) and then execs it."""
    data = ["--data.source", site.data_source, "--data.cache_dir", f"{RUN_MOUNT}/.cache/meshlm"]
    command = ["meshlm", "launch", *agent, "-m", "meshlm.cli", "train", *launch.train_args, *data,
               "--log.run_dir", run_dir]  # fmt: skip
    if site.check:
        return ["sh", "-c", _kubernetes_check(launch, image, run_dir, shlex.join(data), command, first)]
    return command


def kubernetes(launch: Launch, site: Site, image: str) -> str:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1, operator ≥ 1.7) with an elastic policy; the
    operator passes the rendezvous to the agent (PET_* variables). Every worker is `_pod_spec`'s.
    `replicas` = nodes + spares: the spares' agents wait in torchrun's rendezvous. With an elastic policy the
    operator marks the job Succeeded as soon as one worker exits 0 (training-operator release-1.9,
    pkg/controller.v1/pytorch/pytorchjob_controller.go, UpdateJobStatus: `ElasticPolicy != nil && succeeded
    > 0`), so a worker a signal stopped exits STOP_EXIT, which `restartPolicy: OnFailure` restarts (and the
    ExitCode policy would too). Written as JSON, which is valid YAML."""
    name = job_name(launch.name)
    run_dir = f"{RUN_MOUNT}/{name}"
    first = '[ "${PET_RDZV_ENDPOINT%:*}" = "$ME" ]'  # the rendezvous host the operator names
    command = _train_command(launch, site, [], image, run_dir, first)
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "annotations": {"meshlm/plan": launch.summary}},
        "spec": {
            "nprocPerNode": str(launch.nproc_per_node),
            "runPolicy": {"backoffLimit": launch.max_restarts},
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": launch.min_nodes,
                "maxReplicas": launch.nodes,
                "maxRestarts": launch.agent_restarts,
                "rdzvConf": [{"key": "join_timeout", "value": str(JOIN_TIMEOUT_S)}],
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": launch.nodes + launch.spares,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": _pod_spec(launch, site, image, command)},
                }
            },
        },
    }
    return json.dumps(job, indent=2, ensure_ascii=False) + "\n"


def kubernetes_job(launch: Launch, site: Site, image: str) -> str:
    """A plain Kubernetes indexed Job (batch/v1, Kubernetes ≥ 1.28 for its podFailurePolicy without a feature
    gate) and the headless Service that gives its pods DNS names, as one `kind: List`: what any cluster runs
    without Kubeflow's training operator (whose v1 PyTorchJob controller was removed upstream in 2025). Pod i
    is `NAME-i.NAME`; every agent meets at `NAME-0.NAME` (c10d rendezvous). `restartPolicy: Never` with a
    podFailurePolicy: a pod that exits STOP_EXIT (stopped by a signal after its save, steps left) or that a
    disruption ended (eviction, preemption: the DisruptionTarget condition) is replaced without counting
    against `backoffLimit`; the Job completes only when every index exits 0 (trained to its last step). No
    spares (`TARGET_SHAPES`). Written as JSON, which is valid YAML."""
    name = job_name(launch.name)
    run_dir = f"{RUN_MOUNT}/{name}"
    agent = [*launch.agent_options(), f"--rdzv-endpoint={name}-0.{name}:{RDZV_PORT}", f"--rdzv-id={name}",
             f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}"]  # fmt: skip
    first = '[ "${JOB_COMPLETION_INDEX:?set by the Job controller}" = 0 ]'
    command = _train_command(launch, site, agent, image, run_dir, first)
    labels = {"meshlm/job": name}
    pod = _pod_spec(launch, site, image, command, restart="Never") | {"subdomain": name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "publishNotReadyAddresses": True,  # names resolve as soon as pods run: the rendezvous comes first
            "ports": [{"name": "rendezvous", "port": RDZV_PORT}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "annotations": {"meshlm/plan": launch.summary}},
        "spec": {
            "completionMode": "Indexed",
            "completions": launch.nodes,
            "parallelism": launch.nodes,
            "backoffLimit": launch.max_restarts,
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "Ignore",
                        "onExitCodes": {"containerName": "pytorch", "operator": "In", "values": [STOP_EXIT]},
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]
            },
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    manifest = {"apiVersion": "v1", "kind": "List", "items": [service, job]}
    return json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"


CHECK_POLL_S = 2  # Kubernetes: how often the other workers look for the first worker's verdict


def _kubernetes_check(launch: Launch, image: str, run_dir: str, data: str, command: list[str], first: str) -> str:
    """--check: the container's command as a POSIX sh script. The first worker (`first`, a shell test: the
    rendezvous host the operator names in PET_RDZV_ENDPOINT, or a Job's index 0) runs `meshlm check` with the
    run's arguments, once per arguments and image, and leaves its verdict in the run directory on the shared
    claim (.check-passed, .check-failed); the other workers wait for it. Only after a pass does any worker
    exec `command` (`meshlm launch`, which gets the kubelet's SIGTERM); after a failure every worker exits
    with one line, and a restarted pod does not check again (remove .check-failed to). Until its exec the
    script is the container's first process, which the kernel lets ignore any signal it has no handler for:
    the check runs in the background, and the kubelet's SIGTERM ends the container at once (nothing trained
    yet) with STOP_EXIT, not at the grace's SIGKILL."""
    args = check_args(launch, [data], shlex.quote(f"{run_dir}/check"))
    failed = '"meshlm: meshlm check failed (exit $CHECK_RC; its report is above): not training"'
    lines = [
        "set -u",
        f"MESHLM_RUN_DIR={shlex.quote(run_dir)}",
        'mkdir -p "$MESHLM_RUN_DIR"',
        "# this pod's hostname, its name: from the container runtime, else the kernel's",
        'ME="${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}"',
        "# this shell is the container's first process until the exec below: a stop signal it has no trap for",
        "# would be ignored until the kubelet's SIGKILL; during the check nothing is trained, nothing to save",
        "# (a trap runs only once a command ends: the check runs in the background, and this shell waits)",
        "meshlm_stop() {",
        '  echo "meshlm: stopped by a signal during meshlm check: nothing trained, nothing to save" >&2',
        "  trap '' TERM INT HUP",
        "  kill -TERM 0 2>/dev/null  # the check and what it started (this shell now ignores it)",
        f"  exit {STOP_EXIT}",
        "}",
        "trap meshlm_stop TERM INT HUP",
        "# --check: `meshlm check` trains a shrunken replica of this run on this node's CPUs at world 1 and at the",
        "# layout mapped onto a few ranks and compares them (docs/check.md), on the first worker only, before",
        "# any training; once per arguments and image (.check-passed, .check-failed in the run directory)",
        "meshlm_check() {",
        '  ARGS="${TMPDIR:-/tmp}/meshlm-check-args"',
        f'  printf \'%s\\0\' {shlex.quote(image)} "$@" > "$ARGS"',
        '  if cmp -s "$ARGS" "$MESHLM_RUN_DIR/.check-passed"; then',
        '    echo "meshlm: meshlm check passed before with these arguments ($MESHLM_RUN_DIR/.check-passed)"',
        '  elif cmp -s "$ARGS" "$MESHLM_RUN_DIR/.check-failed"; then',
        '    echo "meshlm: meshlm check failed before with these arguments: not training (remove'
        ' $MESHLM_RUN_DIR/.check-failed to check again)" >&2',
        "    return 1",
        f"  elif {first}; then",
        '    meshlm check "$@" || {',
        "      CHECK_RC=$?",
        '      cp "$ARGS" "$MESHLM_RUN_DIR/.check-failed"',
        f"      echo {failed} >&2",
        '      return "$CHECK_RC"',
        "    }",
        '    cp "$ARGS" "$MESHLM_RUN_DIR/.check-passed"',
        "  else",
        '    echo "meshlm: waiting for meshlm check on the first worker"',
        '    until cmp -s "$ARGS" "$MESHLM_RUN_DIR/.check-passed"; do',
        '      if cmp -s "$ARGS" "$MESHLM_RUN_DIR/.check-failed"; then',
        '        echo "meshlm: meshlm check failed on the first worker: not training" >&2',
        "        return 1",
        "      fi",
        f"      sleep {CHECK_POLL_S}",
        "    done",
        "  fi",
        "}",
        f"meshlm_check {args} &",
        "CHECK_PID=$!",
        'wait "$CHECK_PID" || exit',
        f"exec {shlex.join(command)}",
    ]
    return "\n".join(lines) + "\n"
