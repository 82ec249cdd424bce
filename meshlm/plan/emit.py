"""Launch files for a plan: a Slurm sbatch script, a Kubeflow PyTorchJob manifest, a Kubernetes indexed Job with
its headless Service, and a SkyPilot managed-job task, each running `meshlm train` under `meshlm launch`
(torchrun's elastic agent, which exits 0, or MESHLM_STOP_EXIT's code, after a clean
SIGTERM save however many SIGTERMs reach the agent and its workers) with the plan's layout, checkpoint
interval, restarts, node range and spares: exactly the pool the planner priced for that launcher
(`TARGET_SHAPES`), so every node count a file lets torchrun start with is one the layout runs at.

Every file puts the run directory and the token cache on storage every node sees (a Slurm path, a
ReadWriteMany claim, a bucket in SkyPilot's MOUNT_CACHED mode), passes the data source through, wires the
scheduler's preemption signal to meshlm's SIGTERM save (Slurm `--signal=TERM@…` to the step's tasks +
`--requeue`, Kubernetes `terminationGracePeriodSeconds`, SkyPilot job recovery) with a grace sized from the
plan's own step and checkpoint times, bounds restarts per allocation, and installs meshlm from what the user
names (a pip requirement or a wheel; Kubernetes: the image), never from the machine that planned it. Every
user value is validated or quoted where it is written (a shell word, a JSON or YAML string). A run a signal
stopped with steps left exits STOP_EXIT where a scheduler would read 0 as "succeeded" (Kubernetes, SkyPilot),
and each of those files tells its scheduler to restart on that code. A CPU run asks for the CPUs its ranks
use (one each), a GPU run CPUS_PER_GPU per GPU. docs/clusters.md shows the files.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass

from meshlm.plan.cost import DEFAULT_COSTS
from meshlm.plan.hardware import Hardware
from meshlm.plan.memory import Candidate
from meshlm.plan.search import Plan, PlannerError
from meshlm.plan.spot import Estimate, Pool, Shapes, duration_text

RDZV_PORT = 29500
JOIN_TIMEOUT_S = 900  # how long the first agents wait for the others (nodes can be slow to boot)
GRACE_FLOOR_S = 30.0  # fault.grace_s is at least this (start-up, a slow filesystem's first write)
GRACE_MARGIN = 2.0  # ... and this × (a step + a checkpoint write), the plan's own estimates
SYNC_STEPS = 10  # log.every's default: the loop checks for SIGTERM at every log step (and others) ...
SYNC_S = 60.0  # ... which the emitted log.every brings to at most a minute apart (at least every step)
TEARDOWN_S = 60  # beyond fault.grace_s: the agent's own teardown and the process exits
MAX_RESTARTS = (3, 50)  # torchrun restarts allowed per allocation: at least / at most
ERROR_RELAUNCHES = 3  # SkyPilot: whole-cluster relaunches after a non-preemption failure (a crash loops)
SHM_GB_PER_GPU = 8  # /dev/shm for data workers and NCCL's shared-memory transport (Kubernetes' default: 64 MB)
CPUS_PER_GPU = 8
# `meshlm launch`'s code for a run a signal stopped with steps left, under MESHLM_STOP_EXIT: 128 + SIGTERM (what
# launch exits with when a worker did not stop cleanly, meshlm.launch.SIGTERM_EXIT), a code each scheduler here
# restarts: Kubeflow's ExitCode policy retries codes >= 128 (training-operator pkg/util/train/train_util.go,
# IsRetryableExitCode), OnFailure any non-zero; a Job's podFailurePolicy ignores it; SkyPilot recovers on it
# (`recover_on_exit_codes`)
STOP_EXIT = 143
SLURM_MAX_WARN_S = 65535  # sbatch --signal's largest lead time
TIME_LIMIT_S = 24 * 3600.0  # Slurm's --time: a common partition limit; the job requeues itself at its end
PVC = "meshlm-runs"
RUN_MOUNT = "/meshlm-run"
# What each launcher can express: SkyPilot replaces its whole cluster when a node goes (rigid, no spares);
# no launcher here runs one job on spot and on-demand nodes at once (a mixed pool).
# A Kubernetes Job completes only when every index exits 0: a spare whose agent still waits when the rendezvous
# closes would fail it, so the Job target has no spares.
TARGET_SHAPES = {
    "slurm": Shapes(mixed=False),
    "kubernetes": Shapes(mixed=False),
    "kubernetes-job": Shapes(mixed=False, spares=False),
    "skypilot": Shapes(mixed=False, spares=False, elastic=False),
}


@dataclass(frozen=True)
class Site:
    """Where and how the job runs, beyond the plan: the data, the shared run directory, meshlm's install."""

    data_source: str
    install: str = ""  # a pip requirement ('meshlm==0.1.0') or a wheel (path or URL); "" = the image has meshlm
    run_dir: str = ""  # Slurm: a path on shared storage (default: $SLURM_SUBMIT_DIR/runs/NAME)
    time_limit_s: float = TIME_LIMIT_S
    cpus_per_gpu: int = CPUS_PER_GPU
    partition: str = ""
    account: str = ""
    pvc: str = PVC
    spot_selector: str = "karpenter.sh/capacity-type=spot"
    bucket: str = ""
    check: bool = False  # --check: `meshlm check` on one node before training (`check_block`)


@dataclass(frozen=True)
class Launch:
    """What a cluster needs to start a plan: nodes, agents and the trainer's command line."""

    name: str
    nodes: int  # MAX: the full layout's nodes
    min_nodes: int  # MIN: the fewest an elastic job keeps training on (= nodes when rigid)
    spares: int  # extra nodes started whose agents wait in the rendezvous
    nproc_per_node: int
    max_restarts: int  # restarts per allocation: torchrun's in place, or (in_place False) the scheduler's
    train_args: tuple[str, ...]  # after `-m meshlm.cli train`
    spot: bool = False
    grace_s: float = GRACE_FLOOR_S
    gpu: bool = True
    wall_s: float = 0.0  # expected wall time (resubmissions of a time-limited allocation)
    summary: str = ""
    # False: every restart is a fresh agent started by the scheduler (a replica group refuses torchrun's in-place
    # restart, meshlm.train.replicas), so torchrun restarts nothing and max_restarts counts the scheduler's
    in_place: bool = True

    @property
    def agent_restarts(self) -> int:
        """torchrun's --max-restarts: max_restarts where it restarts in place, else 0."""
        return self.max_restarts if self.in_place else 0

    def agent_options(self) -> list[str]:
        """The node range, processes per node, restarts and rendezvous backend of `meshlm launch`."""
        return [
            f"--nnodes={self.min_nodes}:{self.nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.agent_restarts}",
            "--rdzv-backend=c10d",
        ]


def node_cpus(launch: Launch, cpus_per_gpu: int) -> int:
    """The CPUs a node's task asks for: `cpus_per_gpu` per GPU (data workers, the host side of each GPU), or
    on CPUs one per rank (torchrun runs each rank with one intra-op thread), which a 2-CPU node can give."""
    return cpus_per_gpu * launch.nproc_per_node if launch.gpu else launch.nproc_per_node


def _mesh_override(s: Candidate, elastic: bool) -> str:
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
    storage_gbps: float = DEFAULT_COSTS.storage_gbps,
    fused_loss: bool = True,
) -> Launch:
    """The launch of a priced plan on `pick` (default: its recommended pool); `model_args` select the model
    (`--config FILE` or `--model.*` overrides). Checkpoints every Young interval in steps; on GPUs the fast
    flags (bf16 autocast, compiled blocks); a log step (where SIGTERM is noticed) at most SYNC_S apart, and
    SIGTERM saved within `grace_for` that and the plan's checkpoint time (written at `storage_gbps`)."""
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
    log_every = max(1, min(SYNC_STEPS, math.floor(SYNC_S / step_s)))
    grace = grace_for(step_s * log_every, plan.checkpoint_bytes / (storage_gbps * 1e9))
    fields["fault.grace_s"] = grace
    fields["log.every"] = log_every
    fields["log.progress"] = False  # a batch job: plain lines, no progress bar
    if not fused_loss:  # as planned (--no-fused-loss); on by default in the trainer
        fields["train.fused_loss"] = False
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
        grace_s=grace,
    )


def grace_for(sync_s: float, checkpoint_s: float) -> float:
    """fault.grace_s: time for SIGTERM -> saved and exited. The loop notices the signal at its next log step
    (`sync_s` apart at most), then writes a checkpoint: GRACE_MARGIN × that, plus GRACE_FLOOR_S."""
    return float(math.ceil(GRACE_FLOOR_S + GRACE_MARGIN * (sync_s + checkpoint_s)))


def job_name(name: str) -> str:
    """A name Slurm and Kubernetes both accept: lower-case letters, digits and '-'."""
    clean = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return ("meshlm-" + clean)[:63].rstrip("-")


# What Slurm accepts as a partition or account name (a comma-separated list for partitions): written into an
# `#SBATCH` line, anything else (a newline, a space, a quote) would change the script.
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
# A pip requirement on meshlm's distribution: name, optional extras, optional version specifiers
REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*"
                         r"((===|==|~=|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+\s*,?\s*)*")  # fmt: skip


def slurm_name(flag: str, text: str) -> str:
    """A `--partition` / `--account` value: Slurm's name characters only, one line otherwise."""
    if not SLURM_NAME.fullmatch(text):
        raise PlannerError(f"{flag} {text!r}: expected a Slurm name (letters, digits, '_', '.', '-'; a comma between "
                        "several)")  # fmt: skip
    return text


def install_spec(text: str) -> str:
    """--install: a pip requirement ('meshlm==0.1.0', 'meshlm[hf]>=0.1') or a wheel (a path or URL on the
    cluster's side ending in .whl), written as given; one line otherwise."""
    if (text.endswith(".whl") and "\n" not in text) or REQUIREMENT.fullmatch(text.strip()):
        return text.strip()
    raise PlannerError(f"--install {text!r}: expected a pip requirement such as 'meshlm==0.1.0' or a meshlm wheel "
                    "(a path or URL ending in .whl)")  # fmt: skip


KUBERNETES_TARGETS = ("kubernetes", "kubernetes-job")


def emit_flags(target: str, image: str, bucket: str, data_source: str, install: str) -> str:
    """Check the flags `--emit TARGET` needs; return --install as `install_spec` reads it. Every missing flag
    is named in one line (not one per attempt), and --install with a Kubernetes target, which runs --image
    and would ignore it, is refused."""
    missing = []
    if target in KUBERNETES_TARGETS and not image:
        missing.append("--image (the container image with meshlm installed)")
    if target == "skypilot" and not bucket:
        missing.append("--bucket (where the run directory lives, e.g. s3://my-bucket/runs)")
    if not data_source:
        missing.append("--data-source (the corpus to train on: a path on shared storage, 'hf:NAME' or 'stdlib'; or "
                       "a --model config with data.source)")  # fmt: skip
    if target in ("slurm", "skypilot") and not install:
        missing.append("--install (a pip requirement such as 'meshlm==0.1.0', or a meshlm wheel: a path or URL "
                       "ending in .whl)")  # fmt: skip
    if missing:
        raise PlannerError(f"--emit {target} needs " + ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "")
                        + missing[-1])  # fmt: skip
    if target in KUBERNETES_TARGETS:
        if install:
            raise PlannerError(f"--install {install!r}: --emit {target} runs --image, which must have meshlm installed "
                            "(pip install meshlm in its Dockerfile); drop --install")  # fmt: skip
        return ""
    return install_spec(install)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _duration(seconds: float) -> str:
    return duration_text(seconds) if math.isfinite(seconds) else "unbounded"


def comment(text: str) -> str:
    """`text` as one comment line's words (a newline in a user value cannot end the comment)."""
    return " ".join(text.split())


def check_args(launch: Launch, data: list[str], workdir: str) -> str:
    """`meshlm check`'s arguments as shell words: the target world (the plan's GPUs; an elastic layout names no
    dp), where the replica's runs go, and then exactly the run's own `meshlm train` arguments and data
    (`data`: words written as they are, e.g. '"$MESHLM_CACHE_DIR"')."""
    own = shlex.join(["--world", str(launch.nodes * launch.nproc_per_node)])
    return " ".join([own, "--workdir", workdir, shlex.join(launch.train_args), *data])


def check_block(identity: str, args: str, failed: str) -> list[str]:
    """POSIX sh lines that run `meshlm check ARGS` before any training, unless the same arguments and install
    (`identity`, a shell word) passed before in MESHLM_RUN_DIR (.check-passed), so a requeued or recovered job
    does not check again. A check that fails (exit != 0: 1 a difference, 2 bad input) prints `failed`, one
    line that may name CHECK_RC, and the script exits with its code."""
    return [
        "# --check: `meshlm check` trains a shrunken replica of this run on this node's CPUs at world 1 and at the",
        "# layout mapped onto a few ranks and compares them (docs/check.md), before any training; once per",
        "# arguments and install (.check-passed), so a resumed job does not check again",
        "meshlm_check() {",
        f'  printf \'%s\\0\' {identity} "$@" > "$MESHLM_RUN_DIR/.check-args"',
        '  if cmp -s "$MESHLM_RUN_DIR/.check-args" "$MESHLM_RUN_DIR/.check-passed"; then',
        '    echo "meshlm: meshlm check passed before with these arguments ($MESHLM_RUN_DIR/.check-passed)"',
        "    return 0",
        "  fi",
        '  meshlm check "$@" || {',
        "    CHECK_RC=$?",
        f"    echo {failed} >&2",
        '    return "$CHECK_RC"',
        "  }",
        '  mv -f "$MESHLM_RUN_DIR/.check-args" "$MESHLM_RUN_DIR/.check-passed"',
        "}",
        f"meshlm_check {args} || exit",
    ]


def slurm_run(command: str, cpus: int, data_source: str) -> str:
    """The sbatch script's step: `srun` of one `meshlm launch` agent per node, this shell's SIGTERM passed on
    through Slurm, and the requeue after a signal stopped the run once its workers saved (see `slurm`). The
    requeue follows only `meshlm launch`'s stopped file, never this shell's own SIGTERM: a SIGTERM that reaches
    the shell after the run trained to its last step (`scancel --batch`, a `B:` warning in teardown) would
    otherwise requeue a finished job."""
    return f"""# meshlm launch writes this file when a signal stopped it after its workers saved, and never once they
# trained to the last step: Slurm delivers the time limit's --signal and a preemption's SIGTERM to the step's
# tasks, not to this shell, and only this file says the run has work left
export MESHLM_STOPPED_FILE="$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID"
rm -f "$MESHLM_STOPPED_FILE"
STOPPED=0
# SIGTERM to this shell alone: on to the step's tasks through Slurm (srun would turn a SIGTERM into SIGKILL)
on_term() {{
  [ "$STOPPED" = 1 ] && return
  STOPPED=1
  echo "meshlm: SIGTERM to the batch shell: passed on to the step's tasks of job $SLURM_JOB_ID"
  scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap on_term TERM
srun --kill-on-bad-exit=0 --ntasks-per-node=1 --cpus-per-task={cpus} \\
  {command} \\
  --data.source {shlex.quote(data_source)} --data.cache_dir "$MESHLM_CACHE_DIR" \\
  --log.run_dir "$MESHLM_RUN_DIR" "$@" &
STEP=$!
wait "$STEP"
while kill -0 "$STEP" 2>/dev/null; do wait "$STEP"; done
wait "$STEP"
RC=$?
if [ "$RC" = 0 ] && [ -e "$MESHLM_STOPPED_FILE" ]; then
  rm -f "$MESHLM_STOPPED_FILE"
  echo "meshlm: stopped by a signal after saving; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || echo "meshlm: requeue refused; resubmit this script to resume"
fi
exit "$RC"
"""


# The sbatch script's rendezvous host: the first node, at an address every node reaches (see `slurm`)
SLURM_HEAD = r"""HEAD_NODE=${HEAD_NODE:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
# the rendezvous at the head node's address: Slurm's NodeAddr for it, resolved here, never to a loopback
# address (Debian's /etc/hosts maps a machine's own name to 127.0.1.1, which no other node reaches), else its name
meshlm_address() {
  NODE_ADDR=$(scontrol show node "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  for ADDR in $(getent ahostsv4 "${NODE_ADDR:-$1}" 2>/dev/null | cut -d ' ' -f 1); do
    case "$ADDR" in 127.*) ;; *) echo "$ADDR"; return ;; esac
  done
  echo "${NODE_ADDR:-$1}"
}
HEAD_ADDR=${HEAD_ADDR:-$(meshlm_address "$HEAD_NODE")}
# meshlm launch on the node Slurm names HEAD_NODE hosts the rendezvous store (torchrun's own guess compares
# this machine's addresses with HEAD_ADDR and can miss)
export MESHLM_RDZV_HOST_NODE="$HEAD_NODE"
"""


def slurm(launch: Launch, site: Site) -> str:
    """An sbatch script: one task per node runs a `meshlm launch` agent; the first node hosts the
    rendezvous. `--no-kill` keeps the allocation when a node dies (the agents re-form the group on the
    survivors and the spares). `--signal=TERM@G` (no `B:`) has Slurm deliver SIGTERM to the step's tasks, the
    agents and their workers, G seconds before the time limit, as a preemption's grace and
    `scancel --signal=TERM JOB` do; they save once and exit 0, and `meshlm launch` leaves MESHLM_STOPPED_FILE
    so this shell requeues the job. A SIGTERM to this shell alone (`scancel --batch`) is passed on the same
    way, through Slurm (`scancel --signal=TERM`), never to `srun`, which turns SIGTERM into SIGKILL for every
    task (Slurm's src/srun/srun_job.c, srun(1) "SIGNALS"); only MESHLM_STOPPED_FILE requeues, so a finished
    run never runs again. meshlm is pip-installed from `site.install` into MESHLM_VENV, once. HEAD_NODE,
    HEAD_ADDR, RDZV_PORT, RDZV_ID, RDZV_JOIN_TIMEOUT, MESHLM_RUN_DIR, MESHLM_CACHE_DIR, MESHLM_VENV and
    MESHLM_INSTALL can be set from outside; extra arguments go to `meshlm train`. Every user value is quoted
    or validated."""
    rdzv = '--rdzv-endpoint="$HEAD_ADDR:$RDZV_PORT" --rdzv-id="$RDZV_ID" --rdzv-conf=join_timeout="$RDZV_JOIN_TIMEOUT"'
    train = shlex.join(["-m", "meshlm.cli", "train", *launch.train_args])
    command = f"meshlm launch {shlex.join(launch.agent_options())} {rdzv} {train}"
    nodes = f"{launch.min_nodes}-{launch.nodes}" if launch.min_nodes < launch.nodes else str(launch.nodes)
    spares = ""
    if launch.spares:
        spares = f" ({launch.spares} hot spare{'s' if launch.spares > 1 else ''} wait in the rendezvous)"
    run = slurm_run(command, node_cpus(launch, site.cpus_per_gpu), site.data_source)
    return slurm_script(launch, site, f"{nodes} nodes{spares}", run)


def slurm_script(launch: Launch, site: Site, trains_on: str, run: str) -> str:
    """The sbatch script around `run` (its steps and requeue): the `#SBATCH` header for `launch`'s nodes and
    spares, the rendezvous head, the run directory, meshlm's install into MESHLM_VENV and, with --check,
    `meshlm check` of the launch's arguments. `trains_on` completes the comment "Trains on ..."."""
    if not site.install:
        raise PlannerError("--emit slurm needs --install (a pip requirement such as 'meshlm==0.1.0', or a meshlm "
                        "wheel on the cluster), which every job installs into MESHLM_VENV")  # fmt: skip
    name = job_name(launch.name)
    warn = math.ceil(launch.grace_s + TEARDOWN_S)
    window = min(site.time_limit_s, 365 * 86400.0)
    if warn > min(window / 2, SLURM_MAX_WARN_S):  # warned at once, every allocation would stop before training
        raise PlannerError(f"--time-limit {_duration(window)}: the save before the limit needs {_duration(warn)} "
                        f"(fault.grace_s {launch.grace_s:g} s + {TEARDOWN_S} s); give at least twice that, "
                        f"and at most {SLURM_MAX_WARN_S} s of it")  # fmt: skip
    allocations = math.ceil(launch.wall_s / window) if math.isfinite(launch.wall_s) and launch.wall_s else 1
    cpus = node_cpus(launch, site.cpus_per_gpu)
    options = [f"--gpus-per-node={launch.nproc_per_node}"] if launch.gpu else []
    options += [f"--partition={slurm_name('--partition', site.partition)}"] if site.partition else []
    options += [f"--account={slurm_name('--account', site.account)}"] if site.account else []
    header = "".join(f"#SBATCH {option}\n" for option in options)
    run_dir = shlex.quote(site.run_dir) if site.run_dir else f'"$SLURM_SUBMIT_DIR"/runs/{name}'
    data = ["--data.source", shlex.quote(site.data_source), "--data.cache_dir", '"$MESHLM_CACHE_DIR"']
    check = ""
    if site.check:  # in this batch shell: on the allocation's first node, before `srun` starts any training
        failed = ('"meshlm: meshlm check failed (exit $CHECK_RC; its report is above): not training, not '
                  'requeueing job $SLURM_JOB_ID"')  # fmt: skip
        args = check_args(launch, [*data, '"$@"'], '"$MESHLM_RUN_DIR/check"')
        check = "".join(line + "\n" for line in check_block('"$MESHLM_INSTALL"', args, failed))
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={launch.nodes + launch.spares}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={cpus}
{header}#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH --time={_hms(window)}
#SBATCH --signal=TERM@{warn}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={name}-%j.out
# {comment(launch.summary)}
# Trains on {trains_on}; expected wall time {_duration(launch.wall_s)}, about {allocations} allocation(s)
# of the --time limit (the job requeues itself at the limit and resumes from its newest checkpoint).
# Written by `meshlm plan --emit slurm`.
set -uo pipefail
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
{SLURM_HEAD}RDZV_PORT=${{RDZV_PORT:-{RDZV_PORT}}}
RDZV_ID=${{RDZV_ID:-$SLURM_JOB_ID}}
RDZV_JOIN_TIMEOUT=${{RDZV_JOIN_TIMEOUT:-{JOIN_TIMEOUT_S}}}
MESHLM_RUN_DIR=${{MESHLM_RUN_DIR:-{run_dir}}}
MESHLM_CACHE_DIR=${{MESHLM_CACHE_DIR:-$(dirname "$MESHLM_RUN_DIR")/.cache/meshlm}}
mkdir -p "$MESHLM_RUN_DIR"
# meshlm from MESHLM_INSTALL, pip-installed once into MESHLM_VENV on storage every node sees
MESHLM_INSTALL=${{MESHLM_INSTALL:-{shlex.quote(site.install)}}}
MESHLM_VENV=${{MESHLM_VENV:-$(dirname "$MESHLM_RUN_DIR")/.venv/meshlm}}
if [ "$(cat "$MESHLM_VENV/.meshlm-install" 2>/dev/null)" != "$MESHLM_INSTALL" ]; then
  python3 -m venv "$MESHLM_VENV" && "$MESHLM_VENV/bin/pip" install --quiet "$MESHLM_INSTALL" \\
    && printf '%s\\n' "$MESHLM_INSTALL" > "$MESHLM_VENV/.meshlm-install" \\
    || {{ echo "meshlm: could not install $MESHLM_INSTALL into $MESHLM_VENV" >&2; exit 1; }}
fi
export PATH="$MESHLM_VENV/bin:$PATH"
{check}{run}"""


SKYPILOT_ACCELERATORS = {"A100-40GB": "A100", "A100-80GB": "A100-80GB", "H100-SXM": "H100", "H200": "H200"}


def _sky_resources(launch: Launch, site: Site, pool: Pool, hw: Hardware) -> list[str]:
    """The task's `resources:` lines: accelerators, CPUs, spot with on demand as the fallback, job recovery."""
    accelerator = SKYPILOT_ACCELERATORS.get(hw.name, hw.name)
    resources = [f"  accelerators: {json.dumps(f'{accelerator}:{launch.nproc_per_node}')}"] if launch.gpu else []
    resources += [f"  cpus: {node_cpus(launch, site.cpus_per_gpu)}+"]
    if pool.spot:
        resources += ["  any_of:", "    - use_spot: true", "    - use_spot: false"]
    else:
        resources += ["  use_spot: false"]
    # SkyPilot's controller (0.14.1) marks a job that exits 0 SUCCEEDED (sky/jobs/controller.py,
    # JobController._monitor_one_task_impl) and recovers a failed one whose exit code is in
    # recover_on_exit_codes without counting it against max_restarts_on_errors (sky/jobs/recovery_strategy.py,
    # StrategyExecutor.should_restart_on_failure): a run stopped by a signal exits STOP_EXIT
    resources += ["  job_recovery:", "    strategy: EAGER_NEXT_REGION",
                  f"    max_restarts_on_errors: {ERROR_RELAUNCHES}", "    recover_on_exit_codes:",
                  f"      - {STOP_EXIT}"]  # fmt: skip
    return resources


def skypilot(launch: Launch, site: Site, pool: Pool, hw: Hardware, task: str = "", train_extra: str = "",
             envs: tuple[tuple[str, str], ...] = ()) -> str:  # fmt: skip
    """A SkyPilot task YAML for `sky jobs launch`: the whole cluster on spot with on demand as the fallback
    (`any_of`) or on demand, `job_recovery` relaunching it after a preemption (and at most ERROR_RELAUNCHES
    times after a failure, so a deterministic crash does not loop), the run directory on `site.bucket` in
    MOUNT_CACHED mode (local writes, so meshlm's atomic folder rename stays atomic, uploaded behind), meshlm
    pip-installed from `site.install` (a requirement, a wheel URL, or a local wheel SkyPilot uploads), user
    values as JSON strings (valid YAML), and a `run` command that starts one `meshlm launch` agent per
    node from SkyPilot's node variables (c10d rendezvous on the first IP, so a worker that dies restarts the
    group in place up to `--max-restarts` times per launch); `meshlm train` resumes from the
    newest valid checkpoint there. SkyPilot replaces the whole cluster when a node goes, so the job is rigid
    (`TARGET_SHAPES`). Written by hand as a plain subset of YAML (no anchors, flow collections or tags).
    A replica group's task (meshlm.plan.emit_groups) names itself `task`, adds `envs` and passes `train_extra`
    (shell words) to `meshlm train`."""
    name = job_name(launch.name)
    resources = _sky_resources(launch, site, pool, hw)
    mounts = [f"  {RUN_MOUNT}:", f"    source: {json.dumps(site.bucket)}", "    mode: MOUNT_CACHED"]
    if not site.install:
        raise PlannerError("--emit skypilot needs --install (a pip requirement such as 'meshlm==0.1.0', or a meshlm "
                        "wheel: a path SkyPilot uploads or a URL)")  # fmt: skip
    wheel = site.install.rsplit("/", 1)[-1]
    if site.install.endswith(".whl") and "://" not in site.install:  # a local wheel: SkyPilot uploads it
        mounts += [f"  {json.dumps('/meshlm-dist/' + wheel)}: {json.dumps(site.install)}"]
        setup = shlex.join(["pip", "install", f"/meshlm-dist/{wheel}"])
    else:
        setup = shlex.join(["pip", "install", site.install])
    setup_lines = [setup]
    if site.check:  # `run` starts on no node before every node's setup has ended
        failed = '"meshlm: meshlm check failed (exit $CHECK_RC; its report is above): not training"'
        data = ['--data.source "$MESHLM_DATA" --data.cache_dir "$MESHLM_CACHE_DIR" ${MESHLM_TRAIN_ARGS:-}']
        args = check_args(launch, data, '"$MESHLM_RUN_DIR/check"')
        block = check_block(shlex.quote(setup), args, failed)
        setup_lines = [f"{setup} || exit", "# the check on the first node only",
                       'if [ "${SKYPILOT_SETUP_NODE_RANK:-0}" = 0 ]; then', '  mkdir -p "$MESHLM_RUN_DIR"',
                       *(f"  {line}" for line in block), "fi"]  # fmt: skip
    train = shlex.join(["-m", "meshlm.cli", "train", *launch.train_args])
    extra = train_extra + " " if train_extra else ""
    run = f"""set -uo pipefail
# torchrun's shared rendezvous store keeps a previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)
NPROC=${{SKYPILOT_NUM_GPUS_PER_NODE:-0}}
if [ "$NPROC" -lt 1 ]; then NPROC={launch.nproc_per_node}; fi
mkdir -p "$MESHLM_RUN_DIR"
# meshlm train resumes from the newest valid checkpoint in MESHLM_RUN_DIR by itself
# a worker that dies restarts the group in place (c10d rendezvous on the first node); a lost node, the cluster.
# exec: the agent, not this shell, gets the stop signals
exec meshlm launch --nnodes="$SKYPILOT_NUM_NODES:$SKYPILOT_NUM_NODES" --nproc-per-node="$NPROC" \\
  --max-restarts={launch.agent_restarts} --rdzv-backend=c10d --rdzv-endpoint="$HEAD_IP:$MESHLM_PORT" \\
  --rdzv-id="${{SKYPILOT_TASK_ID:-meshlm}}" --rdzv-conf=join_timeout={JOIN_TIMEOUT_S} \\
  {train} {extra}--data.source "$MESHLM_DATA" --data.cache_dir "$MESHLM_CACHE_DIR" \\
  --log.run_dir "$MESHLM_RUN_DIR" ${{MESHLM_TRAIN_ARGS:-}}"""
    lines = [
        f"# {comment(launch.summary)}",
        f"# Written by `meshlm plan --emit skypilot`; launch with `sky jobs launch {name}.sky.yaml`.",
        f"name: {task or name}",
        f"num_nodes: {launch.nodes}",
        "resources:",
        *resources,
        "envs:",
        f"  MESHLM_RUN_DIR: {RUN_MOUNT}/{name}",
        f"  MESHLM_CACHE_DIR: {RUN_MOUNT}/.cache/meshlm",
        f"  MESHLM_DATA: {json.dumps(site.data_source)}",
        f'  MESHLM_PORT: "{RDZV_PORT}"',
        '  MESHLM_TRAIN_ARGS: ""',
        f'  MESHLM_STOP_EXIT: "{STOP_EXIT}"',
        '  MESHLM_STOP_AFTER: ""',
        *(f"  {key}: {json.dumps(value)}" for key, value in envs),
        "file_mounts:",
        *mounts,
        "setup: |",
        *(f"  {line}" for line in setup_lines),
        "run: |",
        *(f"  {line}" for line in run.splitlines()),
    ]
    return "\n".join(lines) + "\n"
