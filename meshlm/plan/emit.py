"""Launch files for a plan: a Slurm sbatch script, a Kubeflow PyTorchJob manifest and a SkyPilot managed-job
task, each running `meshlm train` under `meshlm launch` (torchrun's elastic agent, which exits 0 after a clean
SIGTERM save however many SIGTERMs reach the agent and its workers) with the plan's layout, checkpoint
interval, restarts, node range and spares: exactly the pool the planner priced for that launcher
(`TARGET_SHAPES`), so every node count a file lets torchrun start with is one the layout runs at.

Every file puts the run directory and the token cache on storage every node sees (a Slurm path, a
ReadWriteMany claim, a bucket in SkyPilot's MOUNT_CACHED mode), passes the data source through, wires the
scheduler's preemption signal to meshlm's SIGTERM save (Slurm `--signal=B:TERM@…` + `--requeue`, Kubernetes
`terminationGracePeriodSeconds`, SkyPilot job recovery) with a grace above `fault.grace_s`, bounds restarts
per allocation, and installs meshlm from a wheel or a source tree. docs/clusters.md shows the three files.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from meshlm.plan.hardware import Hardware
from meshlm.plan.memory import Strategy
from meshlm.plan.search import Plan, PlanError
from meshlm.plan.spot import Estimate, Pool, Shapes, duration_text

RDZV_PORT = 29500
JOIN_TIMEOUT_S = 900  # how long the first agents wait for the others (nodes can be slow to boot)
GRACE_S = 120.0  # fault.grace_s written into every file: SIGTERM -> saved and exited within this
TEARDOWN_S = 60  # beyond fault.grace_s: the agent's own teardown and the process exits
MAX_RESTARTS = (3, 50)  # torchrun restarts allowed per allocation: at least / at most
ERROR_RELAUNCHES = 3  # SkyPilot: whole-cluster relaunches after a non-preemption failure (a crash loops)
SHM_GB_PER_GPU = 8  # /dev/shm for data workers and NCCL's shared-memory transport (Kubernetes' default: 64 MB)
CPUS_PER_GPU = 8
TIME_LIMIT_S = 24 * 3600.0  # Slurm's --time: a common partition limit; the job requeues itself at its end
PVC = "meshlm-runs"
RUN_MOUNT = "/meshlm-run"
# What each launcher can express: SkyPilot replaces its whole cluster when a node goes (rigid, no spares);
# no launcher here runs one job on spot and on-demand nodes at once (a mixed pool).
TARGET_SHAPES = {
    "slurm": Shapes(mixed=False),
    "kubernetes": Shapes(mixed=False),
    "skypilot": Shapes(mixed=False, spares=False, elastic=False),
}


@dataclass(frozen=True)
class Site:
    """Where and how the job runs, beyond the plan: the data, the shared run directory, meshlm's install."""

    data_source: str
    install: str = ""  # a wheel file or a source directory (pyproject.toml); "" = the image has meshlm
    run_dir: str = ""  # Slurm: a path on shared storage (default: $SLURM_SUBMIT_DIR/runs/NAME)
    time_limit_s: float = TIME_LIMIT_S
    cpus_per_gpu: int = CPUS_PER_GPU
    partition: str = ""
    pvc: str = PVC
    spot_selector: str = "karpenter.sh/capacity-type=spot"
    bucket: str = ""


@dataclass(frozen=True)
class Launch:
    """What a cluster needs to start a plan: nodes, agents and the trainer's command line."""

    name: str
    nodes: int  # MAX: the full layout's nodes
    min_nodes: int  # MIN: the fewest an elastic job keeps training on (= nodes when rigid)
    spares: int  # extra nodes started whose agents wait in the rendezvous
    nproc_per_node: int
    max_restarts: int  # torchrun's, per allocation
    train_args: tuple[str, ...]  # after `-m meshlm.cli train`
    spot: bool = False
    grace_s: float = GRACE_S
    gpu: bool = True
    wall_s: float = 0.0  # expected wall time (resubmissions of a time-limited allocation)
    summary: str = ""

    def agent_args(self, endpoint: str, rdzv_id: str, join_timeout: str = str(JOIN_TIMEOUT_S)) -> list[str]:
        """`meshlm launch`'s (= torchrun's) arguments for one agent, rendezvous at `endpoint` (host:port)."""
        return [
            f"--nnodes={self.min_nodes}:{self.nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={join_timeout}",
            "-m",
            "meshlm.cli",
            "train",
            *self.train_args,
        ]


def _mesh_override(s: Strategy, elastic: bool) -> str:
    """The `parallel.layout` value: the full mesh, or without dp for an elastic job, whose dp is whatever
    the world it restarts with leaves."""
    if not elastic:
        return s.layout
    return f"pp={s.pp},cp={s.cp},tp={s.tp}" if s.cp > 1 else f"pp={s.pp},tp={s.tp}"


def restarts_allowed(expected: float, wall_s: float, window_s: float) -> int:
    """torchrun's --max-restarts for one allocation of `window_s`: three times the restarts expected in it
    (of `expected` over the whole `wall_s`), within MAX_RESTARTS."""
    if not math.isfinite(expected) or wall_s <= 0:
        return MAX_RESTARTS[0]
    share = expected * min(1.0, window_s / wall_s) if math.isfinite(wall_s) else expected
    return max(MAX_RESTARTS[0], min(MAX_RESTARTS[1], math.ceil(3 * share)))


def launch_for(
    plan: Plan,
    model_args: list[str],
    seq_len: int,
    global_batch: int,
    train_tokens: float,
    name: str,
    pick: Estimate | None = None,
    precision: str = "bf16",
    gpu: bool = True,
    window_s: float = TIME_LIMIT_S,
) -> Launch:
    """The launch of a priced plan on `pick` (default: its recommended pool); `model_args` select the model
    (`--config FILE` or `--model.*` overrides). Checkpoints every Young interval in steps; on GPUs the fast
    flags (bf16 autocast, compiled blocks); SIGTERM saves within GRACE_S."""
    s = plan.strategy
    pick = pick or plan.cost
    pool = pick.pool
    fields = dict(s.overrides())
    fields["parallel.layout"] = _mesh_override(s, pool.elastic)
    step_s = plan.step.total
    steps = max(1, math.ceil(train_tokens / (global_batch * seq_len)))
    fields["data.seq_len"] = seq_len
    fields["train.global_batch"] = global_batch
    fields["train.steps"] = steps
    fields["checkpoint.every"] = max(1, min(steps, round(pick.interval_s / step_s))) if pick.interval_s else steps
    fields["fault.grace_s"] = GRACE_S
    fields["log.progress"] = False  # a batch job: plain lines, no progress bar
    if gpu:
        fields["train.dtype"] = "bf16" if precision == "bf16" else "fp32"
        fields["train.compile"] = True
    args = [*model_args]
    for key, value in fields.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += [f"--{key}", text.removesuffix(".0") if isinstance(value, float) else text]
    return Launch(
        name=name,
        nodes=pool.nodes,
        min_nodes=pool.min_nodes if pool.elastic else pool.nodes,
        spares=pool.spares,
        nproc_per_node=round(s.gpus / pool.nodes),
        max_restarts=restarts_allowed(pick.restarts, pick.wall_s, window_s),
        train_args=tuple(args),
        spot=pool.spot > 0,
        gpu=gpu,
        wall_s=pick.wall_s,
    )


def job_name(name: str) -> str:
    """A name Slurm and Kubernetes both accept: lower-case letters, digits and '-'."""
    clean = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return ("meshlm-" + clean)[:63].rstrip("-")


def install_source(text: str) -> Path:
    """--install: an existing wheel or a source directory with a pyproject.toml; one line otherwise."""
    path = Path(text).expanduser().resolve()
    if path.is_file() and path.suffix == ".whl":
        return path
    if path.is_dir() and (path / "pyproject.toml").is_file():
        return path
    raise PlanError(f"--install {text}: not a wheel (.whl) or a source directory with a pyproject.toml")


def default_install() -> str:
    """The source tree of the meshlm running this plan, when it is one (a checkout); else ""."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "pyproject.toml").is_file() else ""


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _duration(seconds: float) -> str:
    return duration_text(seconds) if math.isfinite(seconds) else "unbounded"


def slurm(launch: Launch, site: Site) -> str:
    """An sbatch script: one task per node runs a `meshlm launch` agent; the first node hosts the
    rendezvous. `--no-kill` keeps the allocation when a node dies (the agents re-form the group on the
    survivors and the spares); `--signal=B:TERM@G` warns the batch shell G seconds before the time limit,
    which forwards SIGTERM to the step (every agent and worker), waits for the save and requeues the job;
    a preemption signals every process at once, and `--requeue` brings the job back. HEAD_NODE, RDZV_PORT,
    RDZV_ID, RDZV_JOIN_TIMEOUT, MESHLM_RUN_DIR, MESHLM_CACHE_DIR and MESHLM_VENV can be set from outside;
    extra arguments to the script go to `meshlm train`."""
    command = shlex.join(["meshlm", "launch", *launch.agent_args("RDZV_ENDPOINT", "RDZV_ID", "RDZV_JOIN_TIMEOUT")])
    shell = {
        "RDZV_ENDPOINT": '"$HEAD_NODE:$RDZV_PORT"',
        "--rdzv-id=RDZV_ID": '--rdzv-id="$RDZV_ID"',
        "join_timeout=RDZV_JOIN_TIMEOUT": 'join_timeout="$RDZV_JOIN_TIMEOUT"',
    }
    for placeholder, variable in shell.items():
        command = command.replace(placeholder, variable)
    name = job_name(launch.name)
    nodes = f"{launch.min_nodes}-{launch.nodes}" if launch.min_nodes < launch.nodes else str(launch.nodes)
    spares = ""
    if launch.spares:
        spares = f" ({launch.spares} hot spare{'s' if launch.spares > 1 else ''} wait in the rendezvous)"
    warn = math.ceil(launch.grace_s + TEARDOWN_S)
    window = min(site.time_limit_s, 365 * 86400.0)
    allocations = math.ceil(launch.wall_s / window) if math.isfinite(launch.wall_s) and launch.wall_s else 1
    cpus = site.cpus_per_gpu * launch.nproc_per_node
    gpus = f"#SBATCH --gpus-per-node={launch.nproc_per_node}\n" if launch.gpu else ""
    partition = f"#SBATCH --partition={site.partition}\n" if site.partition else ""
    run_dir = site.run_dir or f"$SLURM_SUBMIT_DIR/runs/{name}"
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={launch.nodes + launch.spares}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={cpus}
{gpus}{partition}#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH --time={_hms(window)}
#SBATCH --signal=B:TERM@{warn}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={name}-%j.out
# {launch.summary}
# Trains on {nodes} nodes{spares}; expected wall time {_duration(launch.wall_s)}, about {allocations} allocation(s)
# of the --time limit (the job requeues itself at the limit and resumes from its newest checkpoint).
# Written by `meshlm plan --emit slurm`.
set -uo pipefail
# meshlm runs from MESHLM_VENV (default: the environment that ran `meshlm plan`), on storage every node sees
MESHLM_VENV=${{MESHLM_VENV:-{shlex.quote(site_venv())}}}
export PATH="$MESHLM_VENV/bin:$PATH"
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
HEAD_NODE=${{HEAD_NODE:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
RDZV_PORT=${{RDZV_PORT:-{RDZV_PORT}}}
RDZV_ID=${{RDZV_ID:-$SLURM_JOB_ID}}
RDZV_JOIN_TIMEOUT=${{RDZV_JOIN_TIMEOUT:-{JOIN_TIMEOUT_S}}}
MESHLM_RUN_DIR=${{MESHLM_RUN_DIR:-{run_dir}}}
MESHLM_CACHE_DIR=${{MESHLM_CACHE_DIR:-$(dirname "$MESHLM_RUN_DIR")/.cache/meshlm}}
mkdir -p "$MESHLM_RUN_DIR"
STOPPED=0
# the time limit's warning (B: this shell only) or a preemption: SIGTERM to every agent and worker, then requeue
trap 'STOPPED=1; echo "meshlm: SIGTERM: saving, then requeueing job $SLURM_JOB_ID"; kill -TERM "$STEP" 2>/dev/null' TERM
srun --kill-on-bad-exit=0 --ntasks-per-node=1 --cpus-per-task={cpus} \\
  {command} \\
  --data.source {shlex.quote(site.data_source)} --data.cache_dir "$MESHLM_CACHE_DIR" \\
  --log.run_dir "$MESHLM_RUN_DIR" "$@" &
STEP=$!
wait "$STEP"
while kill -0 "$STEP" 2>/dev/null; do wait "$STEP"; done
wait "$STEP"
RC=$?
if [ "$STOPPED" = 1 ] && [ "$RC" = 0 ]; then
  scontrol requeue "$SLURM_JOB_ID" || echo "meshlm: requeue refused; resubmit this script to resume"
fi
exit "$RC"
"""


def site_venv() -> str:
    """The Python environment running this plan (its bin/ holds `meshlm`)."""
    return sys.prefix


def kubernetes(launch: Launch, site: Site, image: str) -> str:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1, operator ≥ 1.7) with an elastic policy; the
    operator passes the rendezvous to the agent (PET_* variables). Every worker mounts the ReadWriteMany
    claim `site.pvc` (run directory and token cache) and a memory-backed /dev/shm, gets
    terminationGracePeriodSeconds above fault.grace_s for the SIGTERM save, and on a spot pool is pinned to
    spot nodes. `replicas` = nodes + spares: the spares' agents wait in torchrun's rendezvous. Written as
    JSON, which is valid YAML."""
    name = job_name(launch.name)
    run_dir = f"{RUN_MOUNT}/{name}"
    command = ["meshlm", "launch", "-m", "meshlm.cli", "train", *launch.train_args, "--data.source",
               site.data_source, "--data.cache_dir", f"{RUN_MOUNT}/.cache/meshlm",
               "--log.run_dir", run_dir]  # fmt: skip
    shm = f"{SHM_GB_PER_GPU * max(1, launch.nproc_per_node)}Gi"
    limits: dict[str, object] = {"nvidia.com/gpu": launch.nproc_per_node} if launch.gpu else {}
    pod: dict[str, object] = {
        "terminationGracePeriodSeconds": math.ceil(launch.grace_s + TEARDOWN_S),
        "containers": [
            {
                "name": "pytorch",
                "image": image,
                "command": command,
                "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}],
                "resources": {"limits": limits | {"cpu": site.cpus_per_gpu * launch.nproc_per_node}},
                "volumeMounts": [{"name": "run", "mountPath": RUN_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
            }
        ],
        "volumes": [
            {"name": "run", "persistentVolumeClaim": {"claimName": site.pvc}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        ],
    }
    if launch.spot:
        key, _, value = site.spot_selector.partition("=")
        pod["nodeSelector"] = {key: value}
        pod["tolerations"] = [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]
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
                "maxRestarts": launch.max_restarts,
                "rdzvConf": [{"key": "join_timeout", "value": str(JOIN_TIMEOUT_S)}],
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": launch.nodes + launch.spares,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": pod},
                }
            },
        },
    }
    return json.dumps(job, indent=2, ensure_ascii=False) + "\n"


SKYPILOT_ACCELERATORS = {"A100-40GB": "A100", "A100-80GB": "A100-80GB", "H100-SXM": "H100", "H200": "H200"}


def skypilot(launch: Launch, site: Site, pool: Pool, hw: Hardware) -> str:
    """A SkyPilot task YAML for `sky jobs launch`: the whole cluster on spot with on demand as the fallback
    (`any_of`) or on demand, `job_recovery` relaunching it after a preemption (and at most ERROR_RELAUNCHES
    times after a failure, so a deterministic crash does not loop), the run directory on `site.bucket` in
    MOUNT_CACHED mode (local writes, so meshlm's atomic folder rename stays atomic, uploaded behind), meshlm
    installed from a wheel or a source tree, and a `run` command that starts one `meshlm launch` agent per
    node from SkyPilot's node variables (c10d rendezvous on the first IP, so a worker that dies restarts the
    group in place up to `--max-restarts` times per launch); `meshlm train` resumes from the
    newest valid checkpoint there. SkyPilot replaces the whole cluster when a node goes, so the job is rigid
    (`TARGET_SHAPES`). Written by hand as a plain subset of YAML (no anchors, flow collections or tags)."""
    name = job_name(launch.name)
    accelerator = SKYPILOT_ACCELERATORS.get(hw.name, hw.name)
    resources = [f"  accelerators: {accelerator}:{launch.nproc_per_node}"] if launch.gpu else []
    resources += [f"  cpus: {site.cpus_per_gpu * launch.nproc_per_node}+"]
    if pool.spot:
        resources += ["  any_of:", "    - use_spot: true", "    - use_spot: false"]
    else:
        resources += ["  use_spot: false"]
    resources += ["  job_recovery:", "    strategy: EAGER_NEXT_REGION",
                  f"    max_restarts_on_errors: {ERROR_RELAUNCHES}"]  # fmt: skip
    mounts = [f"  {RUN_MOUNT}:", f"    source: {site.bucket}", "    mode: MOUNT_CACHED"]
    workdir: list[str] = []
    install = Path(site.install) if site.install else None
    if install is not None and install.suffix == ".whl":
        mounts += [f"  /meshlm-dist/{install.name}: {install}"]
        setup = f"pip install /meshlm-dist/{install.name}"
    elif install is not None:
        workdir = [f"workdir: {install}"]
        setup = "pip install ."  # SkyPilot syncs workdir to every node and runs setup in it
    else:
        raise PlanError("--emit skypilot needs --install (a meshlm wheel or source directory to install)")
    train = shlex.join(["-m", "meshlm.cli", "train", *launch.train_args])
    run = f"""set -uo pipefail
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)
NPROC=${{SKYPILOT_NUM_GPUS_PER_NODE:-0}}
if [ "$NPROC" -lt 1 ]; then NPROC={launch.nproc_per_node}; fi
mkdir -p "$MESHLM_RUN_DIR"
# meshlm train resumes from the newest valid checkpoint in MESHLM_RUN_DIR by itself
# a worker that dies restarts the group in place (c10d rendezvous on the first node); a lost node, the cluster
meshlm launch --nnodes="$SKYPILOT_NUM_NODES:$SKYPILOT_NUM_NODES" --nproc-per-node="$NPROC" \\
  --max-restarts={launch.max_restarts} --rdzv-backend=c10d --rdzv-endpoint="$HEAD_IP:$MESHLM_PORT" \\
  --rdzv-id="${{SKYPILOT_TASK_ID:-meshlm}}" --rdzv-conf=join_timeout={JOIN_TIMEOUT_S} \\
  {train} --data.source "$MESHLM_DATA" --data.cache_dir "$MESHLM_CACHE_DIR" \\
  --log.run_dir "$MESHLM_RUN_DIR" ${{MESHLM_TRAIN_ARGS:-}}"""
    lines = [
        f"# {launch.summary}",
        f"# Written by `meshlm plan --emit skypilot`; launch with `sky jobs launch {name}.sky.yaml`.",
        f"name: {name}",
        f"num_nodes: {launch.nodes}",
        *workdir,
        "resources:",
        *resources,
        "envs:",
        f"  MESHLM_RUN_DIR: {RUN_MOUNT}/{name}",
        f"  MESHLM_CACHE_DIR: {RUN_MOUNT}/.cache/meshlm",
        f"  MESHLM_DATA: {json.dumps(site.data_source)}",
        f'  MESHLM_PORT: "{RDZV_PORT}"',
        '  MESHLM_TRAIN_ARGS: ""',
        "file_mounts:",
        *mounts,
        "setup: |",
        f"  {setup}",
        "run: |",
        *(f"  {line}" for line in run.splitlines()),
    ]
    return "\n".join(lines) + "\n"
