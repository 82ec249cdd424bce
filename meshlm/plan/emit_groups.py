"""Launch files for a plan run as fault-tolerant replica groups (`meshlm plan --emit TARGET --replica-groups N`,
docs/fault-tolerance.md "Launching replica groups"): N groups, each its own `meshlm launch` of the same run
with `parallel.layout` describing one group (dp / N of the plan's), joined by torchft's lighthouse
(`meshlm lighthouse`). A group that dies is relaunched alone while the others keep training, and heals from a
live peer; the other files of meshlm.plan.emit / emit_k8s are reused for each group.

- Slurm: one sbatch allocation; the lighthouse is one job step (`srun --overlap`, on the first node), each
  group a job step of its own (`srun --exact --kill-on-bad-exit=1`) in a relaunch loop of the batch shell.
- Kubernetes: the lighthouse as a Deployment and its Service, and one PyTorchJob (or indexed Job with its
  headless Service) per group.
- SkyPilot: one Job Group (`execution: parallel`) whose tasks are the lighthouse and the N groups.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from meshlm.plan.emit import (
    RUN_MOUNT,
    Launch,
    Site,
    job_name,
    node_cpus,
    skypilot,
    slurm_script,
)
from meshlm.plan.emit_k8s import kubernetes, kubernetes_job
from meshlm.plan.hardware import Hardware
from meshlm.plan.live import HEARTBEAT_TIMEOUT_S, LIGHTHOUSE_JOIN_TIMEOUT_S, LIGHTHOUSE_PORT, group_refusal
from meshlm.plan.memory import Candidate
from meshlm.plan.search import Plan, PlannerError, SearchResult
from meshlm.plan.spot import Pool

GROUP_PORT_OFFSET = 100  # group g's rendezvous on RDZV_PORT + 100 + g: groups that share a node never collide
LIGHTHOUSE_CPUS = 2
RELAUNCH_WAIT_S = 10  # Slurm: seconds between a group's failed step and its relaunch (MESHLM_RELAUNCH_WAIT_S)
SKYPILOT_LIGHTHOUSE = "lighthouse"  # the Job Group's task name: its head is `lighthouse-0.GROUP` (service discovery)


def lighthouse_command() -> list[str]:
    """`meshlm lighthouse` with the timeouts the planner prices (meshlm.plan.live): a quorum of at least 1
    group, a dead group dropped after the join timeout (3 or more groups) or the heartbeat timeout (2)."""
    return ["meshlm", "lighthouse", "--port", str(LIGHTHOUSE_PORT), "--min-replicas", "1",
            "--join-timeout-s", f"{LIGHTHOUSE_JOIN_TIMEOUT_S:g}",
            "--heartbeat-timeout-s", f"{HEARTBEAT_TIMEOUT_S:g}"]  # fmt: skip


def group_plans(result: SearchResult, groups: int, global_batch: int) -> SearchResult:
    """The plans that can run as `groups` replica groups on their recommended pool, in the search's order;
    none: one line with why the first cannot."""
    if groups <= 1:
        return result

    def refusal(p: Plan) -> str:
        pool = p.cost.pool
        return group_refusal(p.strategy, groups, global_batch, pool.nodes, round(p.strategy.gpus / pool.nodes))

    fit = [p for p in result.plans if p.offerings is not None and not refusal(p)]  # priced, as #1 must be
    if not fit:
        raise PlannerError(f"--replica-groups {groups}: no fitting layout runs as {groups} replica groups; the first "
                           f"({result.plans[0].strategy.layout}): {refusal(result.plans[0])}")  # fmt: skip
    return dataclasses.replace(result, plans=fit)


def group_launch(launch: Launch, s: Candidate, groups: int) -> Launch:
    """The launch of ONE of `groups` groups: its nodes (a share of one node when the job has one), rigid, no
    spares, `parallel.layout` with dp / groups, and `--fault.replica_groups`."""
    args = list(launch.train_args)
    args[args.index("--parallel.layout") + 1] = str(dataclasses.replace(s.mesh, dp=s.dp // groups))
    nodes = max(1, launch.nodes // groups)
    nproc = launch.nproc_per_node if launch.nodes >= groups else launch.nproc_per_node // groups
    return dataclasses.replace(launch, nodes=nodes, min_nodes=nodes, spares=0, nproc_per_node=nproc,
                               train_args=(*args, "--fault.replica_groups", str(groups)))  # fmt: skip


# The batch shell's part after the install (`slurm_groups` fills it in): the lighthouse's and each group's
# relaunch loops, the wait for every group, the lighthouse stopped, the requeue of a stopped job.
GROUPS_RUN = """# {groups} replica groups (docs/fault-tolerance.md, "Launching replica groups"): the lighthouse
# is one job step, each group another; a group whose step fails is relaunched alone, the others train on
export RDZV_PORT RDZV_ID RDZV_JOIN_TIMEOUT MESHLM_RUN_DIR MESHLM_CACHE_DIR
export LIGHTHOUSE_PORT=${{LIGHTHOUSE_PORT:-{lighthouse_port}}}
export LIGHTHOUSE="$HEAD_ADDR:$LIGHTHOUSE_PORT"
# between a group's end and its relaunch: a step Slurm refuses at once (no free nodes yet) is not retried in a burst
MESHLM_RELAUNCH_WAIT_S=${{MESHLM_RELAUNCH_WAIT_S:-{relaunch_wait}}}
MESHLM_STOPPING="$MESHLM_RUN_DIR/.stopping-$SLURM_JOB_ID"
MESHLM_GROUPS_DONE="$MESHLM_RUN_DIR/.groups-done-$SLURM_JOB_ID"
LIGHTHOUSE_PID_FILE="$MESHLM_RUN_DIR/.lighthouse-$SLURM_JOB_ID"
rm -f "$MESHLM_STOPPING" "$MESHLM_GROUPS_DONE" "$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID-g"*
# SIGTERM to this shell alone: on to every step's tasks through Slurm (srun would turn it into SIGKILL)
on_term() {{
  [ -e "$MESHLM_STOPPING" ] && return
  touch "$MESHLM_STOPPING"
  echo "meshlm: SIGTERM to the batch shell: passed on to the steps' tasks of job $SLURM_JOB_ID"
  scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap on_term TERM
# the job is being stopped: a signal reached this shell, or a group saved and left its stopped file
stopping() {{
  [ -e "$MESHLM_STOPPING" ] || ls "$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID-g"* >/dev/null 2>&1
}}
# on every node of a group's step: its `meshlm launch` agent, the rendezvous on the step's first node
meshlm_group_step() {{
  GROUP_HEAD=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)
  export MESHLM_RDZV_HOST_NODE="$GROUP_HEAD"
  exec meshlm launch {agent} \\
    --rdzv-endpoint="$(meshlm_address "$GROUP_HEAD"):$((RDZV_PORT + {port_offset} + MESHLM_REPLICA_GROUP))" \\
    --rdzv-id="$RDZV_ID-g$MESHLM_REPLICA_GROUP-$MESHLM_GROUP_ATTEMPT" --rdzv-conf=join_timeout="$RDZV_JOIN_TIMEOUT" \\
    {train} --fault.lighthouse "$LIGHTHOUSE" \\
    --data.source {data_source} --data.cache_dir "$MESHLM_CACHE_DIR" \\
    --log.run_dir "$MESHLM_RUN_DIR" "$@"
}}
export -f meshlm_group_step meshlm_address
# group $1 as a step of its own, relaunched alone (a fresh agent) while it fails, at most {relaunches} times
meshlm_group() {{
  G=$1
  shift
  ATTEMPT=0
  while :; do
    export MESHLM_REPLICA_GROUP=$G MESHLM_GROUP_ATTEMPT=$ATTEMPT
    export MESHLM_STOPPED_FILE="$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID-g$G"
    srun --exact --kill-on-bad-exit=1 --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 \\
      --cpus-per-task={cpus}{gpus} bash -c 'meshlm_group_step "$@"' meshlm-group "$@"
    RC=$?
    if [ "$RC" = 0 ] || stopping; then return "$RC"; fi
    ATTEMPT=$((ATTEMPT + 1))
    if [ "$ATTEMPT" -gt {relaunches} ]; then
      echo "meshlm: replica group $G exited $RC, relaunched {relaunches} times: not again" >&2
      return "$RC"
    fi
    echo "meshlm: replica group $G exited $RC: relaunched alone ($ATTEMPT/{relaunches}); the others train on"
    sleep "$MESHLM_RELAUNCH_WAIT_S"
  done
}}
# the lighthouse on the first node, relaunched there if it fails, until every group has ended
meshlm_lighthouse() {{
  ATTEMPT=0
  while [ ! -e "$MESHLM_GROUPS_DONE" ]; do
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" --kill-on-bad-exit=1 {lighthouse} &
    echo "$!" > "$LIGHTHOUSE_PID_FILE"
    wait "$!"
    RC=$?
    if [ -e "$MESHLM_GROUPS_DONE" ] || stopping; then return 0; fi
    ATTEMPT=$((ATTEMPT + 1))
    if [ "$ATTEMPT" -gt {relaunches} ]; then
      echo "meshlm: the lighthouse exited $RC, relaunched {relaunches} times: not again" >&2
      return "$RC"
    fi
    echo "meshlm: the lighthouse exited $RC: relaunching it on $HEAD_NODE"
  done
}}
meshlm_lighthouse &
LIGHTHOUSE_LOOP=$!
GROUPS_PIDS=""
for G in $(seq 0 {last}); do
  meshlm_group "$G" "$@" &
  GROUPS_PIDS="$GROUPS_PIDS $!"
done
RC=0
for PID in $GROUPS_PIDS; do
  wait "$PID"
  while kill -0 "$PID" 2>/dev/null; do wait "$PID"; done
  wait "$PID"
  CODE=$?
  if [ "$RC" = 0 ]; then RC=$CODE; fi
done
touch "$MESHLM_GROUPS_DONE"
kill -TERM "$(cat "$LIGHTHOUSE_PID_FILE" 2>/dev/null)" 2>/dev/null
wait "$LIGHTHOUSE_LOOP"
STOPPED=$(ls "$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID-g"* 2>/dev/null | wc -l)
rm -f "$MESHLM_STOPPING" "$MESHLM_GROUPS_DONE" "$LIGHTHOUSE_PID_FILE" "$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID-g"*
if [ "$RC" = 0 ] && [ "$STOPPED" -gt 0 ]; then
  echo "meshlm: stopped by a signal after saving; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || echo "meshlm: requeue refused; resubmit this script to resume"
fi
exit "$RC"
"""


def slurm_groups(launch: Launch, group: Launch, groups: int, site: Site) -> str:
    """The sbatch script of `groups` replica groups in one allocation (`launch`'s nodes and spares).

    Slurm semantics (srun(1), sbatch(1), Slurm 22.05): `--no-kill` keeps the allocation when a node fails;
    only the steps on that node are killed, and "the user may launch new job steps on the remaining nodes".
    Each group is its own step, `srun --exact` (only the CPUs it asks for, so groups that share a node fit
    side by side) with `--kill-on-bad-exit=1` (a task that exits non-zero ends its step, not the job, nor
    other steps), started afresh by the batch shell when it ends non-zero, on whichever nodes of the
    allocation are free (a spare, a node the dead one's group no longer holds), at most `max_restarts`
    times: a fresh `meshlm launch` per attempt (`--max-restarts=0`: torchrun's own in-place restart of a
    gloo group read the previous attempt's addresses, /work/notes/ftprobe.md §4), its rendezvous on the
    step's first node. The lighthouse is a step with `--overlap`, which shares all resources with the other
    steps, so it takes no CPU from a group. Slurm's time-limit warning and `scancel --signal=TERM` reach
    every step's tasks: each group saves and exits 0 leaving its stopped file, no group is relaunched once
    any has stopped, and the job requeues itself as the single-group file does."""
    cpus = node_cpus(group, site.cpus_per_gpu)
    gpus = f" --gpus-per-node={group.nproc_per_node}" if group.gpu else ""
    train = shlex.join(["-m", "meshlm.cli", "train", *group.train_args])
    agent = shlex.join([f"--nnodes={group.nodes}:{group.nodes}", f"--nproc-per-node={group.nproc_per_node}",
                        "--max-restarts=0", "--rdzv-backend=c10d"])  # fmt: skip
    lighthouse = shlex.join(lighthouse_command()[:3]) + ' "$LIGHTHOUSE_PORT" ' + shlex.join(lighthouse_command()[4:])
    run = GROUPS_RUN.format(
        groups=groups,
        last=groups - 1,
        data_source=shlex.quote(site.data_source),
        relaunches=group.max_restarts,
        nodes=group.nodes,
        port_offset=GROUP_PORT_OFFSET,
        lighthouse_port=LIGHTHOUSE_PORT,
        relaunch_wait=RELAUNCH_WAIT_S,
        agent=agent,
        train=train,
        cpus=cpus,
        gpus=gpus,
        lighthouse=lighthouse,
    )
    per = f"{group.nodes} node{'s' if group.nodes > 1 else ''}" if launch.nodes >= groups else "a share of a node"
    spares = f", {launch.spares} spare node{'s' if launch.spares > 1 else ''} for relaunches" if launch.spares else ""
    return slurm_script(launch, site, f"{groups} replica groups of {per}{spares}", run)


def _lighthouse_objects(name: str, image: str, launch: Launch) -> list[dict]:
    """The lighthouse as a Deployment (one replica: its ReplicaSet recreates the pod wherever it dies, with
    `restartPolicy: Always`, the only one a Deployment allows) and a ClusterIP Service `NAME-lighthouse`,
    the stable address every group dials."""
    labels = {"meshlm/lighthouse": name}
    container = {"name": "lighthouse", "image": image, "command": lighthouse_command(),
                 "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}],
                 "resources": {"limits": {"cpu": str(LIGHTHOUSE_CPUS)}}}  # fmt: skip
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{name}-lighthouse", "annotations": {"meshlm/plan": launch.summary}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-lighthouse"},
        "spec": {"selector": labels, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT}]},
    }
    return [deployment, service]


def _as_group(objects: list[dict], g: int, run_dir: str) -> list[dict]:
    """A group's objects: MESHLM_REPLICA_GROUP in every container's environment, and the run directory all
    groups share (each group's file is written under its own name)."""
    for obj in objects:
        spec = obj["spec"]
        template = (
            spec["pytorchReplicaSpecs"]["Worker"]["template"] if obj["kind"] == "PyTorchJob" else spec.get("template")
        )
        if template is None:
            continue
        for container in template["spec"]["containers"]:
            container["env"].append({"name": "MESHLM_REPLICA_GROUP", "value": str(g)})
            command = container["command"]
            command[command.index("--log.run_dir") + 1] = run_dir
    return objects


def kubernetes_groups(group: Launch, groups: int, site: Site, image: str, indexed: bool = False) -> str:
    """The lighthouse's Deployment and Service, and per group a PyTorchJob `NAME-gG` (`indexed`: an indexed
    Job and its headless Service), as one `kind: List`. Each group is its own job, so what restarts a group
    never touches another. The training operator reconciles each PyTorchJob's pods alone
    (kubeflow/training-operator pkg/controller.v1/common/pod.go, JobController.ReconcilePods): a worker pod
    that failed under `restartPolicy: OnFailure` is deleted and created again ("job ... is restarting because
    ... replica(s) failed"), a missing one (its node preempted) is created again, and the group's other
    agents re-form its rendezvous (torchrun's elastic agent, its own `maxRestarts`). An indexed Job replaces
    a failed pod of its index (`restartPolicy: Never` + podFailurePolicy, emit_k8s.kubernetes_job). Every
    group dials `NAME-lighthouse:29510` and writes to the same run directory on the shared claim. Written as
    JSON, which is valid YAML."""
    name = job_name(group.name)
    run_dir = f"{RUN_MOUNT}/{name}"
    lighthouse = ("--fault.lighthouse", f"{name}-lighthouse:{LIGHTHOUSE_PORT}")
    items = _lighthouse_objects(name, image, group)
    for g in range(groups):
        # torchrun restarts nothing in place: the operator's pod restarts, counted by backoffLimit, start a fresh
        # agent instead
        one = dataclasses.replace(
            group, name=f"{group.name} g{g}", train_args=(*group.train_args, *lighthouse), in_place=False
        )
        if indexed:
            objects = json.loads(kubernetes_job(one, site, image))["items"]
        else:
            objects = [json.loads(kubernetes(one, site, image))]
        items += _as_group(objects, g, run_dir)
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2, ensure_ascii=False) + "\n"


def skypilot_groups(group: Launch, groups: int, site: Site, pool: Pool, hw: Hardware) -> str:
    """A SkyPilot Job Group (SkyPilot ≥ 0.14, experimental: docs/source/examples/job-groups.rst): a header
    (`execution: parallel`, the N groups as `primary_tasks`, so the lighthouse, an auxiliary task, is ended
    once they finish) and one task per group beside the lighthouse's. Each task recovers from a preemption
    on its own, "without affecting other tasks"; a group dials the lighthouse at `lighthouse-0.$GROUP` (the
    Job Group's service discovery, which SkyPilot provides on Kubernetes only as of 0.14). `sky jobs launch
    FILE` starts it."""
    name = job_name(group.name)
    tasks = [f"group-{g}" for g in range(groups)]
    header = [
        "---",
        f"# {' '.join(group.summary.split())}",
        f"# Written by `meshlm plan --emit skypilot --replica-groups {groups}`; launch with `sky jobs launch FILE`.",
        f"name: {name}",
        "execution: parallel",
        f"primary_tasks: [{', '.join(tasks)}]",
        "termination_delay: 30s",
    ]
    wheel = site.install.rsplit("/", 1)[-1]
    mounts, install = [], site.install
    if site.install.endswith(".whl") and "://" not in site.install:  # a local wheel: SkyPilot uploads it
        install = f"/meshlm-dist/{wheel}"
        mounts = ["file_mounts:", f"  {json.dumps(install)}: {json.dumps(site.install)}"]
    lighthouse = [
        "---",
        f"name: {SKYPILOT_LIGHTHOUSE}",
        "resources:",
        f"  cpus: {LIGHTHOUSE_CPUS}+",
        "  use_spot: false",
        *mounts,
        "setup: |",
        f"  {shlex.join(['pip', 'install', install])}",
        "run: |",
        f"  exec {shlex.join(lighthouse_command())}",
    ]
    address = f'"{SKYPILOT_LIGHTHOUSE}-0.$SKYPILOT_JOBGROUP_NAME:{LIGHTHOUSE_PORT}"'
    docs = []
    for g, task in enumerate(tasks):
        # no in-place torchrun restart (refused by a group): SkyPilot relaunches the task with a fresh agent
        fresh = dataclasses.replace(group, in_place=False)
        text = skypilot(fresh, site, pool, hw, task=task, train_extra=f"--fault.lighthouse {address}",
                        envs=(("MESHLM_REPLICA_GROUP", str(g)),))  # fmt: skip
        docs.append("---\n" + "\n".join(line for line in text.splitlines() if not line.startswith("#")))
    return "\n".join(header + lighthouse) + "\n" + "\n".join(docs) + "\n"
