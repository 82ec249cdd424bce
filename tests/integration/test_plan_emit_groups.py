"""`meshlm plan --emit TARGET --replica-groups N` (meshlm/plan/emit_groups.py; docs/fault-tolerance.md "Launching
replica groups"): every group runs the plan's layout with dp / N and `--fault.replica_groups N`, the lighthouse
is launched beside them, and a group that dies is relaunched alone.

- Slurm: the script runs under bash with recording stand-ins for `srun`, `scontrol`, `scancel` and `meshlm`
  (as test_plan_emit.py runs the single-group script): a group whose step fails is relaunched alone, a fresh
  agent and rendezvous per attempt, the others are launched once; a group out of relaunches ends the job
  with its code; groups that stopped after a save requeue the job. On the real one-machine Slurm
  (tests/slurm_cluster.py) `sbatch --test-only` accepts the file.
- Kubernetes: the lighthouse Deployment and Service and each group's PyTorchJob / indexed Job deserialise into
  the kubernetes client's and the Kubeflow SDK's typed models with nothing dropped.
- SkyPilot: a Job Group (multi-document YAML) that yamllint finds clean, whose header names the groups as its
  primary tasks.

Mutations that fail here (each tried): the group step without `--kill-on-bad-exit=1` or the lighthouse
without `--overlap`; a relaunch that does not stop once a group saved (`stopping`); the same rendezvous id
for every attempt; the group's layout left at the whole job's dp; the groups' run directories differing."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import slurm_cluster
from test_plan_emit import INSTALL, RUN_TOML, plan_args, typed_round_trip

from meshlm.config import Config
from meshlm.plan.cli import run_plan

GROUPS = 2


def emit(tmp_path: Path, target: str, *extra: str, groups: int = GROUPS) -> Path:
    """The `test` model planned on 2 cpu ranks of one node (dp=2), written for `groups` replica groups."""
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 2}))
    target_path = tmp_path / f"job.{target}"
    flags = {"slurm": ("--install", INSTALL), "skypilot": ("--install", INSTALL, "--bucket", "s3://b/runs")}
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration), "--top", "1",
            "--emit", target, "--emit-to", str(target_path), "--replica-groups", str(groups), "--time-limit", "1h",
            *flags.get(target, ("--image", "registry/meshlm:1")), *extra)  # fmt: skip
    assert run_plan(plan_args(*argv)) == 0
    return target_path


def train_args(words: list[str]) -> dict[str, str]:
    """`--section.field value` pairs after `train` in a command."""
    rest = words[words.index("train") + 1 :]
    return {rest[i][2:]: rest[i + 1] for i in range(len(rest) - 1) if rest[i].startswith("--")}


def test_replica_groups_that_cannot_be_planned_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """3 groups of dp=2; ZeRO-1 across the groups (no live peer holds a lost shard); --check with groups."""
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML)
    base = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--top", "1", "--data-source", "stdlib")
    for extra, said in (
        (("--replica-groups", "3"), "--replica-groups 3: no fitting layout runs as 3 replica groups"),
        (("--replica-groups", "2", "--zero", "1"), "ZeRO-1 shards the optimizer state across the replicas: a lost "
                                                   "group's shard has no copy on a live peer, so it falls back to "
                                                   "checkpoint restart; valid: ZeRO 0 (--zero 0)"),
        (("--replica-groups", "2", "--check", "--emit", "kubernetes", "--image", "i"),
         "--check with --replica-groups 2"),
    ):  # fmt: skip
        assert run_plan(plan_args(*base, *extra)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def recorders(tmp_path: Path) -> tuple[Path, Path]:
    """bin/ with stand-ins that append one line per call to `calls`: `srun` (its options, then runs its command
    as Slurm's does, passing SIGTERM on), `meshlm` (launch: its argv and group, then the exit code in
    codes/gG-aA, 0 when absent; `stop` there: leaves MESHLM_STOPPED_FILE and exits 0; `lateN`: exits N after
    2 s; lighthouse: waits for SIGTERM), `scontrol` (the node n1 at 10.0.0.1; records requeues), `scancel`."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (tmp_path / "codes").mkdir()
    scripts = {
        "srun": f"""#!/bin/bash
printf 'srun %s\\n' "$*" >> {calls}
while [ "${{1#-}}" != "$1" ]; do shift; done
"$@" &
TASK=$!
trap 'kill -TERM $TASK' TERM
while kill -0 $TASK 2>/dev/null; do wait $TASK; done
wait $TASK
""",
        "meshlm": f"""#!/bin/bash
if [ "$1" = lighthouse ]; then
  printf 'lighthouse %s\\n' "$*" >> {calls}
  trap 'exit 0' TERM
  while :; do sleep 0.1; done
fi
printf 'group %s attempt %s host %s: %s\\n' "$MESHLM_REPLICA_GROUP" "$MESHLM_GROUP_ATTEMPT" \\
  "$MESHLM_RDZV_HOST_NODE" "$*" >> {calls}
CODE=$(cat {tmp_path}/codes/g$MESHLM_REPLICA_GROUP-a$MESHLM_GROUP_ATTEMPT 2>/dev/null || echo 0)
if [ "$CODE" = stop ]; then touch "$MESHLM_STOPPED_FILE"; exit 0; fi
if [ "${{CODE#late}}" != "$CODE" ]; then sleep 2; CODE=${{CODE#late}}; fi
exit "$CODE"
""",
        "scontrol": f"""#!/bin/sh
case "$1 $2" in
  "show hostnames") echo n1 ;;
  "show node") echo "NodeName=n1 NodeAddr=10.0.0.1" ;;
  requeue*) echo "requeue $2" >> {calls} ;;
esac
""",
        "scancel": f'#!/bin/sh\necho "scancel $*" >> {calls}\n',
    }
    for tool, text in scripts.items():
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    return bin_dir, calls


def run_script(script: Path, tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "SLURM_STEP_NODELIST": "n1", "SLURM_SUBMIT_DIR": str(tmp_path), "HOME": str(tmp_path),
           "HEAD_ADDR": "10.0.0.1", "MESHLM_VENV": str(tmp_path / "venv"),
           "MESHLM_RUN_DIR": str(tmp_path / "run"), "MESHLM_RELAUNCH_WAIT_S": "0"}  # fmt: skip
    (tmp_path / "venv").mkdir(exist_ok=True)
    (tmp_path / "venv" / ".meshlm-install").write_text(INSTALL + "\n")  # installed: the script skips pip
    return subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_sbatch_script_relaunches_a_failed_group_alone(tmp_path: Path) -> None:
    """Group 1's first step exits 1: it is relaunched alone (a fresh rendezvous id), group 0 runs once, the
    lighthouse (its own step, `--overlap`, on the first node) is stopped once both groups end, exit 0."""
    script = emit(tmp_path, "slurm")
    bin_dir, calls = recorders(tmp_path)
    (tmp_path / "codes" / "g1-a0").write_text("1")
    done = run_script(script, tmp_path, bin_dir)
    assert done.returncode == 0, (done.stdout, done.stderr)
    lines = calls.read_text().splitlines()
    groups = [line for line in lines if line.startswith("group ")]
    assert sorted(line.split(":")[0] for line in groups) == ["group 0 attempt 0 host n1", "group 1 attempt 0 host n1",
                                                             "group 1 attempt 1 host n1"]  # fmt: skip
    assert "replica group 1 exited 1: relaunched alone (1/3); the others train on" in done.stdout
    steps = [line for line in lines if line.startswith("srun ")]
    group_steps = [s for s in steps if "meshlm_group_step" in s]
    assert len(group_steps) == 3 and all("--exact --kill-on-bad-exit=1 --nodes=1 --ntasks=1" in s for s in group_steps)
    (lighthouse,) = [s for s in steps if "lighthouse" in s]
    assert "--overlap" in lighthouse and "--nodelist=n1" in lighthouse
    assert [line for line in lines if line.startswith("lighthouse ")] == [
        "lighthouse lighthouse --port 29510 --min-replicas 1 --join-timeout-s 3 --heartbeat-timeout-s 5"
    ]
    ids = set()
    for line in groups:
        words = line.split(": ", 1)[1].split()
        agent = dict(w.split("=", 1) for w in words[: words.index("-m")] if "=" in w)
        group = int(line.split()[1])
        assert agent["--rdzv-endpoint"] == f"10.0.0.1:{29500 + 100 + group}" and agent["--max-restarts"] == "0"
        ids.add(agent["--rdzv-id"])
        args = train_args(words)
        assert args["parallel.layout"] == "pp=1,dp=1,tp=1" and args["fault.replica_groups"] == str(GROUPS)
        assert args["fault.lighthouse"] == "10.0.0.1:29510" and args["log.run_dir"] == str(tmp_path / "run")
        assert args["train.global_batch"] == "8"  # the whole job's batch: each group takes 8 / 2
    assert ids == {"7-g0-0", "7-g1-0", "7-g1-1"}
    assert not [line for line in lines if line.startswith("requeue")]
    assert not list((tmp_path / "run").glob(".*-7*"))  # its marker files removed


def test_a_group_out_of_relaunches_ends_the_job_and_saved_groups_requeue_it(tmp_path: Path) -> None:
    """Group 0 fails 4 times (3 relaunches allowed): the job exits with its code, not requeued. Then both groups
    stop after a save (their stopped files): the job requeues itself and exits 0; no group is relaunched.
    Last, group 0 saves and stops while group 1 fails after it: the job is stopping, so group 1 is not
    relaunched (the job ends with its code, as the single-group script does)."""
    script = emit(tmp_path, "slurm")
    bin_dir, calls = recorders(tmp_path)
    for attempt in range(4):
        (tmp_path / "codes" / f"g0-a{attempt}").write_text("3")
    done = run_script(script, tmp_path, bin_dir)
    assert done.returncode == 3 and "replica group 0 exited 3, relaunched 3 times: not again" in done.stderr
    assert sum(line.startswith("group 0 ") for line in calls.read_text().splitlines()) == 4
    calls.unlink()
    for g in range(GROUPS):
        (tmp_path / "codes" / f"g{g}-a0").write_text("stop")
    done = run_script(script, tmp_path, bin_dir)
    lines = calls.read_text().splitlines()
    assert done.returncode == 0 and "requeue 7" in lines, (done.stdout, done.stderr)
    assert sum(line.startswith("group ") for line in lines) == GROUPS
    calls.unlink()
    (tmp_path / "codes" / "g1-a0").write_text("late1")
    done = run_script(script, tmp_path, bin_dir)
    lines = calls.read_text().splitlines()
    assert done.returncode == 1 and sum(line.startswith("group 1 ") for line in lines) == 1, lines


def test_the_group_arguments_are_config_fields_with_valid_values(tmp_path: Path) -> None:
    """Every `--section.field value` a group passes `meshlm train` is a field of meshlm's config with a valid
    value."""
    job = json.loads(emit(tmp_path, "kubernetes").read_text())
    command = job["items"][2]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    data = Config().model_dump()
    for key, value in train_args(command).items():
        if key == "config":  # the run's own file, not a field
            continue
        section, name = key.split(".")
        data[section][name] = value
    cfg = Config.model_validate(data)
    assert cfg.fault.replica_groups == GROUPS and cfg.parallel.layout == "pp=1,dp=1,tp=1"


def test_no_group_restarts_torchrun_in_place(tmp_path: Path) -> None:
    """A replica group refuses torchrun's in-place restart (meshlm.train.replicas: a restarted gloo group reads
    its dead attempt's addresses), so every launcher restarts a group as a fresh agent: Slurm's relaunch loop,
    the operator's pod restarts (backoffLimit kept), SkyPilot's task recovery. A file with `--max-restarts` > 0
    or an elasticPolicy maxRestarts > 0 would start groups that stop at once."""
    for target in ("slurm", "kubernetes", "kubernetes-job", "skypilot"):
        text = emit(tmp_path, target).read_text()
        assert not re.search(r"--max-restarts[= ]+[1-9]|\"maxRestarts\": [1-9]", text), target
        if target.startswith("kubernetes"):
            jobs = [item for item in json.loads(text)["items"] if item["kind"] in ("PyTorchJob", "Job")]
            limits = [
                job["spec"].get("backoffLimit", job["spec"].get("runPolicy", {}).get("backoffLimit")) for job in jobs
            ]
            assert all(limit and limit > 0 for limit in limits), (target, limits)


@pytest.mark.skipif(bool(slurm_cluster.missing()), reason="no Slurm here: apt-get install slurm-wlm munge")
@pytest.mark.slow  # starts munged, slurmctld and slurmd: ~10-20 s under load
def test_sbatch_test_only_accepts_the_groups_script(tmp_path: Path) -> None:
    """The real one-machine Slurm: `sbatch --test-only` validates the file's options against the node (2 CPUs:
    two 1-rank groups with --exact side by side) and says when it would start."""
    script = emit(tmp_path, "slurm")
    cluster = slurm_cluster.start(tmp_path / "slurm")
    try:
        done = subprocess.run(["sbatch", "--test-only", str(script)], env=cluster.env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        cluster.stop()
    assert done.returncode == 0 and "to start at" in done.stderr, (done.stdout, done.stderr)


def test_the_kubernetes_files_deserialise_into_the_typed_models(tmp_path: Path) -> None:
    """A Deployment and a Service for the lighthouse, then per group a PyTorchJob (or an indexed Job and its
    headless Service): each into the kubernetes client's (and the Kubeflow SDK's) models, nothing dropped;
    every group with its own MESHLM_REPLICA_GROUP and rendezvous, one run directory, the lighthouse's address."""
    k8s = pytest.importorskip("kubernetes.client")
    kubeflow = pytest.importorskip("kubeflow.training.api_client")
    api, sdk = k8s.ApiClient(), kubeflow.ApiClient()
    for target in ("kubernetes", "kubernetes-job"):
        items = json.loads(emit(tmp_path, target).read_text())["items"]
        deployment, service = items[:2]
        typed_round_trip(api, deployment, "V1Deployment")
        typed_round_trip(api, service, "V1Service")
        assert service["metadata"]["name"] == "meshlm-run-lighthouse" and deployment["spec"]["replicas"] == 1
        assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
        jobs = [item for item in items[2:] if item["kind"] in ("PyTorchJob", "Job")]
        assert [job["metadata"]["name"] for job in jobs] == [f"meshlm-run-g{g}" for g in range(GROUPS)]
        run_dirs = set()
        for g, job in enumerate(jobs):
            if target == "kubernetes":
                worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
                typed_round_trip(api, worker["template"], "V1PodTemplateSpec")
                replicas = {"Worker": {k: v for k, v in worker.items() if k != "template"}}
                typed_round_trip(sdk, job["spec"] | {"pytorchReplicaSpecs": replicas}, "KubeflowOrgV1PyTorchJobSpec")
                pod = worker["template"]["spec"]
            else:
                typed_round_trip(api, job, "V1Job")
                pod = job["spec"]["template"]["spec"]
                assert pod["subdomain"] == f"meshlm-run-g{g}"  # the group's own rendezvous name
            container = pod["containers"][0]
            assert {"name": "MESHLM_REPLICA_GROUP", "value": str(g)} in container["env"]
            args = train_args(container["command"])
            assert args["fault.lighthouse"] == "meshlm-run-lighthouse:29510" and args["fault.replica_groups"] == "2"
            assert args["parallel.layout"] == "pp=1,dp=1,tp=1"
            run_dirs.add(args["log.run_dir"])
        assert run_dirs == {"/meshlm-run/meshlm-run"}


def test_the_skypilot_job_group_is_yamllint_clean_with_the_groups_as_primary_tasks(tmp_path: Path) -> None:
    """A header (`execution: parallel`, the groups primary, so the lighthouse ends with them), the lighthouse
    task on demand and one task per group with MESHLM_REPLICA_GROUP, dialling `lighthouse-0.$JOB_GROUP`."""
    yaml = pytest.importorskip("yaml")
    lint = pytest.importorskip("yamllint.linter")
    config = pytest.importorskip("yamllint.config")
    text = emit(tmp_path, "skypilot").read_text()
    rules = config.YamlLintConfig("extends: default\nrules: {line-length: disable}")
    assert [str(p) for p in lint.run(text, rules)] == []
    header, lighthouse, *groups = yaml.safe_load_all(text)
    assert header["execution"] == "parallel" and header["primary_tasks"] == ["group-0", "group-1"]
    assert lighthouse["name"] == "lighthouse" and lighthouse["resources"]["use_spot"] is False
    assert lighthouse["run"].split()[:3] == ["exec", "meshlm", "lighthouse"]
    for g, task in enumerate(groups):
        assert task["name"] == f"group-{g}" and task["envs"]["MESHLM_REPLICA_GROUP"] == str(g)
        assert '--fault.lighthouse "lighthouse-0.$SKYPILOT_JOBGROUP_NAME:29510"' in task["run"]
        assert "--parallel.layout pp=1,dp=1,tp=1" in task["run"] and "--fault.replica_groups 2" in task["run"]
        assert task["envs"]["MESHLM_RUN_DIR"] == "/meshlm-run/meshlm-run"


def test_skypilot_reads_the_job_group(tmp_path: Path) -> None:
    """SkyPilot's own loader (sky/utils/dag_utils.py, load_dag_from_yaml_str: a multi-document YAML with
    `execution: parallel` is a Job Group) reads it, where skypilot is installed (not a test dependency, as in
    test_plan_emit.py)."""
    dag_utils = pytest.importorskip("sky.utils.dag_utils")
    dag = dag_utils.load_dag_from_yaml_str(emit(tmp_path, "skypilot").read_text())
    assert sorted(t.name for t in dag.tasks) == ["group-0", "group-1", "lighthouse"]


def test_no_group_file_has_a_path_of_the_planning_machine(tmp_path: Path) -> None:
    here = [str(Path(__file__).resolve().parents[2]), os.path.dirname(os.__file__)]
    for target in ("slurm", "kubernetes", "kubernetes-job", "skypilot"):
        text = emit(tmp_path, target).read_text()
        assert not [p for p in here if p in text], target
