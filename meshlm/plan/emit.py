"""Launch files for a plan: a Slurm sbatch script and a Kubeflow PyTorchJob manifest that run `meshlm train`
under torchrun's elastic agent, with the plan's layout, checkpoint interval, restarts and node range, and a
SkyPilot managed-job task (`skypilot`) whose run command starts torchrun from SkyPilot's node variables.

Both start one torchrun agent per node with a c10d rendezvous (Slurm: hosted on the job's first node;
Kubernetes: the training operator's), `--nnodes MIN:MAX` (MIN < MAX when the recommended pool shrinks
elastically), `--max-restarts` sized to the expected restarts, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(pytorch/pytorch#135712, docs/fault-tolerance.md). Hot spares are extra nodes whose agents wait in the
rendezvous until a member is lost. docs/clusters.md shows both files and how to adapt them.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass

from meshlm.plan.hardware import Hardware
from meshlm.plan.memory import Strategy
from meshlm.plan.search import Plan
from meshlm.plan.spot import Pool

RDZV_PORT = 29500
JOIN_TIMEOUT_S = 900  # how long the first agents wait for the others (nodes can be slow to boot)


@dataclass(frozen=True)
class Launch:
    """What a cluster needs to start a plan: nodes, agents and the trainer's command line."""

    name: str
    nodes: int  # MAX: the full layout's nodes
    min_nodes: int  # MIN: the fewest an elastic job keeps training on (= nodes when rigid)
    spares: int  # extra nodes started whose agents wait in the rendezvous
    nproc_per_node: int
    max_restarts: int
    train_args: tuple[str, ...]  # after `-m meshlm.cli train`

    def torchrun_args(self, endpoint: str, rdzv_id: str, join_timeout: str = str(JOIN_TIMEOUT_S)) -> list[str]:
        """torchrun's arguments for one agent, rendezvous at `endpoint` (host:port)."""
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


def launch_for(
    plan: Plan, model_args: list[str], seq_len: int, global_batch: int, train_tokens: float, name: str
) -> Launch:
    """The launch of a priced plan's recommended pool; `model_args` select the model (`--config FILE` or
    `--model.*` overrides). Checkpoints every Young interval in steps; restarts allowed: three times the
    expected number, at least 3."""
    s, pick = plan.strategy, plan.cost
    pool = pick.pool
    fields = dict(s.overrides())
    fields["parallel.layout"] = _mesh_override(s, pool.elastic)
    step_s = plan.step.total
    steps = max(1, math.ceil(train_tokens / (global_batch * seq_len)))
    fields["data.seq_len"] = seq_len
    fields["train.global_batch"] = global_batch
    fields["train.steps"] = steps
    fields["checkpoint.every"] = max(1, min(steps, round(pick.interval_s / step_s))) if pick.interval_s else steps
    args = [*model_args]
    for key, value in fields.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    restarts = pick.restarts if math.isfinite(pick.restarts) else 0.0
    return Launch(
        name=name,
        nodes=pool.nodes,
        min_nodes=pool.min_nodes if pool.elastic else pool.nodes,
        spares=pool.spares,
        nproc_per_node=round(s.gpus / pool.nodes),
        max_restarts=max(3, math.ceil(3 * restarts)),
        train_args=tuple(args),
    )


def job_name(name: str) -> str:
    """A name Slurm and Kubernetes both accept: lower-case letters, digits and '-'."""
    clean = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return ("meshlm-" + clean)[:63].rstrip("-")


def slurm(launch: Launch, summary: str) -> str:
    """An sbatch script: one task per node runs a torchrun agent; the first node hosts the rendezvous.
    HEAD_NODE, RDZV_PORT, RDZV_ID and RDZV_JOIN_TIMEOUT default to the job's own and can be set from outside;
    extra arguments to the script go to `meshlm train` (e.g. --data.source, --log.run_dir on shared storage)."""
    command = shlex.join(["torchrun", *launch.torchrun_args("RDZV_ENDPOINT", "RDZV_ID", "RDZV_JOIN_TIMEOUT")])
    shell = {
        "RDZV_ENDPOINT": '"$HEAD_NODE:$RDZV_PORT"',
        "--rdzv-id=RDZV_ID": '--rdzv-id="$RDZV_ID"',
        "join_timeout=RDZV_JOIN_TIMEOUT": 'join_timeout="$RDZV_JOIN_TIMEOUT"',
    }
    for placeholder, variable in shell.items():
        command = command.replace(placeholder, variable)
    nodes = f"{launch.min_nodes}-{launch.nodes}" if launch.min_nodes < launch.nodes else str(launch.nodes)
    spares = ""
    if launch.spares:
        spares = f" ({launch.spares} hot spare{'s' if launch.spares > 1 else ''} wait in the rendezvous)"
    return f"""#!/bin/bash
#SBATCH --job-name={job_name(launch.name)}
#SBATCH --nodes={launch.nodes + launch.spares}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={launch.nproc_per_node}
#SBATCH --exclusive
# {summary}
# Trains on {nodes} nodes{spares}; written by `meshlm plan --emit slurm`.
set -euo pipefail
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
HEAD_NODE=${{HEAD_NODE:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
RDZV_PORT=${{RDZV_PORT:-{RDZV_PORT}}}
RDZV_ID=${{RDZV_ID:-$SLURM_JOB_ID}}
RDZV_JOIN_TIMEOUT=${{RDZV_JOIN_TIMEOUT:-{JOIN_TIMEOUT_S}}}
srun --kill-on-bad-exit=0 --ntasks-per-node=1 \\
  {command} "$@"
"""


def kubernetes(launch: Launch, summary: str, image: str) -> str:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1, operator ≥ 1.7) with an elastic policy; the
    operator passes the rendezvous to torchrun (PET_* variables). Written as JSON, which is valid YAML."""
    command = ["torchrun", "-m", "meshlm.cli", "train", *launch.train_args]
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(launch.name), "annotations": {"meshlm/plan": summary}},
        "spec": {
            "nprocPerNode": str(launch.nproc_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": launch.min_nodes,
                "maxReplicas": launch.nodes,
                "maxRestarts": launch.max_restarts,
                "rdzvConf": [{"key": "join_timeout", "value": str(JOIN_TIMEOUT_S)}],
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": launch.nodes,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "pytorch",
                                    "image": image,
                                    "command": command,
                                    "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}],
                                    "resources": {"limits": {"nvidia.com/gpu": launch.nproc_per_node}},
                                }
                            ]
                        }
                    },
                }
            },
        },
    }
    return json.dumps(job, indent=2) + "\n"


SKYPILOT_ACCELERATORS = {"A100-40GB": "A100", "A100-80GB": "A100-80GB", "H100-SXM": "H100", "H200": "H200"}
RUN_MOUNT = "/meshlm-run"


def skypilot(launch: Launch, summary: str, pool: Pool, hw: Hardware, bucket: str) -> str:
    """A SkyPilot task YAML for `sky jobs launch`: the whole cluster on spot with on demand as the fallback
    (`any_of`; one SkyPilot cluster cannot mix the two, so a mixed plan runs all spot or all on demand),
    `job_recovery` relaunching it after a preemption, the run directory on `bucket`, and a `run` command
    that starts one torchrun agent per node from SkyPilot's node variables (static rendezvous on the first
    IP) and lets `meshlm train` resume from the newest valid checkpoint there. SkyPilot replaces the whole
    cluster when a node goes, so the job is rigid: spares and elastic shrink do not apply. Written by hand
    as a plain subset of YAML (no anchors, flow collections or tags)."""
    name = job_name(launch.name)
    accelerator = SKYPILOT_ACCELERATORS.get(hw.name, hw.name)
    resources = [f"  accelerators: {accelerator}:{launch.nproc_per_node}"] if hw.name != "cpu" else []
    if pool.spot:
        resources += ["  any_of:", "    - use_spot: true", "    - use_spot: false"]
    else:
        resources += ["  use_spot: false"]
    resources += ["  job_recovery:", "    strategy: EAGER_NEXT_REGION",
                  f"    max_restarts_on_errors: {launch.max_restarts}"]  # fmt: skip
    train = shlex.join(["-m", "meshlm.cli", "train", *launch.train_args])
    run = f"""set -euo pipefail
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)
NPROC=${{SKYPILOT_NUM_GPUS_PER_NODE:-0}}
if [ "$NPROC" -lt 1 ]; then NPROC={launch.nproc_per_node}; fi
mkdir -p "$MESHLM_RUN_DIR"
# meshlm train resumes from the newest valid checkpoint in MESHLM_RUN_DIR by itself
torchrun --nnodes="$SKYPILOT_NUM_NODES" --node-rank="$SKYPILOT_NODE_RANK" --nproc-per-node="$NPROC" \\
  --master-addr="$HEAD_IP" --master-port="$MESHLM_PORT" --max-restarts=0 \\
  {train} --log.run_dir "$MESHLM_RUN_DIR" ${{MESHLM_TRAIN_ARGS:-}}"""
    lines = [
        f"# {summary}",
        f"# Written by `meshlm plan --emit skypilot`; launch with `sky jobs launch {name}.sky.yaml`.",
        f"name: {name}",
        f"num_nodes: {launch.nodes}",
        "resources:",
        *resources,
        "envs:",
        "  MESHLM_PACKAGE: meshlm",
        f"  MESHLM_RUN_DIR: {RUN_MOUNT}/{name}",
        f'  MESHLM_PORT: "{RDZV_PORT}"',
        '  MESHLM_TRAIN_ARGS: ""',
        "file_mounts:",
        f"  {RUN_MOUNT}:",
        f"    source: {bucket}",
        "    mode: MOUNT",
        "setup: |",
        '  pip install "$MESHLM_PACKAGE"',
        "run: |",
        *(f"  {line}" for line in run.splitlines()),
    ]
    return "\n".join(lines) + "\n"
