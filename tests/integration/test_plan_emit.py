"""`meshlm plan --emit slurm|kubernetes` (meshlm/plan/emit.py, docs/clusters.md): each file is parsed and its
keys checked (shared run directory, data source, preemption wiring, restarts, spares, /dev/shm, node range
valid at every count it allows, grace from the plan's own checkpoint time); the PyTorchJob deserialises into
the kubernetes client's and the Kubeflow SDK's typed models with nothing dropped; no file carries a path of
the machine that planned it; every user value that reaches a file is validated or quoted (newlines, `$(...)`,
quotes and spaces through every flag, the script run and parsed). The priced pool is the emitted one, and a
spot trace can change both.

The sbatch script on a real Slurm (time limit, `scancel --signal`, a killed worker) is tests/integration/test_slurm.py.
Here it also runs as two "nodes" on localhost, which a one-machine Slurm cannot start: stand-ins for `srun`
(which, as Slurm's, turns a SIGTERM it receives into SIGKILL for its task) and `scontrol`; one node's worker
SIGKILLed mid-run, the group restarted by the agents and resumed from the newest checkpoint. The PyTorchJob's
container command runs as two "pods" that the kubelet's SIGTERM stops with one save and exit 0."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import free_port

from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state
from meshlm.config import Config, parse_overrides
from meshlm.model.config import PRESETS
from meshlm.plan import Workload, hardware, search
from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.cost import DEFAULT_COSTS
from meshlm.plan.emit import TARGET_SHAPES, Launch, Site, grace_for, launch_for, skypilot, slurm
from meshlm.plan.emit_k8s import kubernetes
from meshlm.plan.search import Constraints, elastic_shrink
from meshlm.plan.spot import Pool, Shapes
from meshlm.train.startup import check_config

RUN_TOML = """[model]
preset = "test"

[data]
seq_len = 64

[train]
global_batch = 8
steps = 4
"""
INSTALL = "meshlm==0.1.0"
LAUNCH = Launch("my model", 8, 4, 2, 8, 12, ("--model.preset", "llama3-8b", "--parallel.layout", "pp=1,tp=8"),
                spot=True, wall_s=86400.0, summary="summary")  # fmt: skip
SITE = Site("/shared/corpus", install=INSTALL, time_limit_s=4 * 3600)


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def shims(tmp_path: Path) -> Path:
    """A MESHLM_VENV as the sbatch script leaves it after installing INSTALL (its marker), whose bin/ has this
    worktree's `meshlm` and stand-ins for Slurm: `srun` runs its command here and, as Slurm's srun does, turns
    a SIGTERM it receives into SIGKILL for it; `scontrol` names this host and records a requeue."""
    venv = tmp_path / "venv"
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    (venv / ".meshlm-install").write_text(INSTALL + "\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done\n"$@" &\nTASK=$!\n'
                                  "trap 'kill -KILL $TASK' TERM\n"
                                  'while kill -0 $TASK 2>/dev/null; do wait $TASK; done\nwait $TASK\n')  # fmt: skip
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\nif [ "$1" = requeue ]; then echo "$2" >> {tmp_path}/requeued; '
                                      'exit 0; fi\necho 127.0.0.1\n')  # fmt: skip
    (bin_dir / "meshlm").write_text(f'#!/bin/sh\nexec {sys.executable} -m meshlm.cli "$@"\n')
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    return venv


def two_node_cpu_plan(tmp_path: Path, *extra: str) -> Path:
    """Plan the `test` model on 2 cpu ranks, one per "node" (a calibration of 1 device per node)."""
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 1}))
    target = tmp_path / "job.sbatch"
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration))
    assert run_plan(plan_args(*argv, "--top", "1", "--emit", "slurm", "--emit-to", str(target), "--install", INSTALL,
                              *extra)) == 0  # fmt: skip
    return target


def sbatch_options(script: str) -> dict[str, str]:
    return dict(line.removeprefix("#SBATCH --").partition("=")[::2] for line in script.splitlines()
                if line.startswith("#SBATCH --"))  # fmt: skip


def agent_words(script: str) -> list[str]:
    """The `meshlm launch ...` command of the sbatch script, shell variables replaced by stand-ins."""
    start = script.index("  meshlm launch ")
    line = script[start : script.index(" &\n", start)].replace("\\\n", " ")
    for variable, value in (('"$HEAD_ADDR:$RDZV_PORT"', "head:1"), ('"$RDZV_ID"', "id"), ('"$RDZV_JOIN_TIMEOUT"', "9"),
                            ('"$MESHLM_CACHE_DIR"', "/cache"), ('"$MESHLM_RUN_DIR"', "/run")):  # fmt: skip
        line = line.replace(variable, value)
    return shlex.split(line)


def _merged(pairs: list[tuple[str, object]]) -> dict:
    data = Config().model_dump()
    for key, value in pairs:
        section, name = key.split(".")
        data[section][name] = value
    return data


def test_an_elastic_range_is_valid_at_every_node_count_it_allows() -> None:
    """The issue's case: 70B on 8 nodes, `pp=1,tp=8`, batch 512 runs only at 4 and 8 nodes (dp 5-7 does not
    divide 512), so the priced pool is not elastic 4-8; with batch 840 (= lcm(5, 6, 7, 8)) every count from 5
    (4 nodes' dp=4 does not fit in memory) to 8 is valid and the launch ranges over exactly those, each a world
    `meshlm train` accepts."""
    hw = hardware("H100-SXM")
    for batch in (512, 840):
        w = Workload(PRESETS["llama3-70b"], 8192, batch, 1.4e12, name="llama3-70b")
        # The layout family, fixed: pp=1, tp=8 and no context parallel (the search's own pick moves with
        # the step-time model; with cp it has no dp to shrink).
        plan = search(w, 64, hw, constraints=Constraints(cp=1, pp=1, tp=8), priced=1).plans[0]
        speed, fewest = elastic_shrink(w, plan.strategy, hw)
        pool = plan.cost.pool
        low = pool.min_nodes if pool.elastic else pool.nodes
        launch = launch_for(plan, ["--model.preset", "llama3-70b"], 8192, batch, 1.4e12, "llama3-70b")
        assert (launch.min_nodes, launch.nodes, launch.nproc_per_node) == (low, 8, 8)
        for nodes in range(low, 9):
            assert speed(nodes) > 0, (batch, nodes)
            cfg = Config.model_validate(_merged(parse_overrides(list(launch.train_args))))
            check_config(cfg, nodes * 8)  # raises a ConfigError where the trainer would refuse the world
        if batch == 512:
            assert speed(5) == speed(6) == speed(7) == 0 and not pool.elastic
        else:
            assert pool.elastic and pool.min_nodes == fewest < 8 and speed(fewest - 1) == 0
            assert launch.train_args[launch.train_args.index("--parallel.layout") + 1] == "pp=1,tp=8"
        assert 3 <= launch.max_restarts <= 50  # per allocation, not thousands
        steps = int(launch.train_args[launch.train_args.index("--train.steps") + 1])
        assert steps == -(-1.4e12 // (batch * 8192))


def test_sbatch_script_has_shared_storage_preemption_requeue_and_spares() -> None:
    script = slurm(LAUNCH, SITE)
    options = sbatch_options(script)
    assert options["nodes"] == "10" and options["gpus-per-node"] == "8"  # 8 + 2 hot spares
    assert options["cpus-per-task"] == "64" and options["time"] == "0-04:00:00"
    assert "no-kill" in options and "requeue" in options and options["job-name"] == "meshlm-my-model"
    kind, _, warn = options["signal"].partition("@")
    # no B:, so Slurm signals the step's tasks (never srun, which would SIGKILL them), with time to save
    assert kind == "TERM" and int(warn) >= LAUNCH.grace_s
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script
    assert "trap on_term TERM" in script and 'scancel --signal=TERM "$SLURM_JOB_ID"' in script
    assert "kill" not in script.split("trap on_term")[0].split("on_term()")[1]  # nothing signals srun itself
    assert 'export MESHLM_STOPPED_FILE="$MESHLM_RUN_DIR/.stopped-$SLURM_JOB_ID"' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "MESHLM_INSTALL=${MESHLM_INSTALL:-meshlm==0.1.0}" in script
    words = agent_words(script)
    assert words[:4] == ["meshlm", "launch", "--nnodes=4:8", "--nproc-per-node=8"] and words[-1] == "$@"
    train = words[words.index("train") + 1 : -1]
    assert train[: len(LAUNCH.train_args)] == list(LAUNCH.train_args)
    assert train[len(LAUNCH.train_args) :] == ["--data.source", "/shared/corpus", "--data.cache_dir", "/cache",
                                               "--log.run_dir", "/run"]  # fmt: skip
    assert 'MESHLM_RUN_DIR=${MESHLM_RUN_DIR:-"$SLURM_SUBMIT_DIR"/runs/meshlm-my-model}' in script


def test_pytorchjob_has_a_claim_shm_grace_spares_and_spot_nodes() -> None:
    job = json.loads(kubernetes(LAUNCH, SITE, "registry/meshlm:1"))
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == "8"
    policy = job["spec"]["elasticPolicy"]
    assert (policy["rdzvBackend"], policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (
        "c10d", 4, 8, 12,
    )  # fmt: skip
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 10  # the 2 spares' agents wait in the rendezvous
    pod = worker["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= LAUNCH.grace_s
    container = pod["containers"][0]
    command = container["command"]
    assert command[:5] == ["meshlm", "launch", "-m", "meshlm.cli", "train"]
    train = command[5:]
    assert train[train.index("--data.source") + 1] == "/shared/corpus"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "meshlm-runs"
    assert train[train.index("--log.run_dir") + 1].startswith(mounts["run"] + "/")
    assert train[train.index("--data.cache_dir") + 1].startswith(mounts["run"] + "/")
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "64Gi"
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    assert container["image"] == "registry/meshlm:1" and container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    gke = Site("/shared/corpus", spot_selector="cloud.google.com/gke-spot=true")
    gke_pod = json.loads(kubernetes(LAUNCH, gke, "i"))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert gke_pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    on_demand = json.loads(kubernetes(Launch("m", 2, 2, 0, 8, 3, ()), SITE, "i"))
    assert "nodeSelector" not in on_demand["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def test_each_launcher_is_priced_only_on_pools_it_can_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """70B, batch 840: Slurm and Kubernetes get the elastic spot pool; SkyPilot (rigid, no spares) is priced
    without elastic shrink or spares; none is priced on a mixed pool, which no launcher runs."""
    # The layout family, fixed (pp=1, tp=8, no context parallel): it keeps a dp to shrink.
    argv = ["--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--global-batch", "840", "--train-tokens",
            "1.4T", "--top", "1", "--json", "--data-source", "/data", "--image", "i", "--bucket", "s3://b",
            "--layout", "pp=1,tp=8,cp=1"]  # fmt: skip
    for target, shapes in TARGET_SHAPES.items():
        path = tmp_path / target
        install = () if target.startswith("kubernetes") else ("--install", INSTALL)  # the image has meshlm
        assert run_plan(plan_args(*argv, *install, "--emit", target, "--emit-to", str(path))) == 0
        offers = json.loads(capsys.readouterr().out)["plans"][0]["offerings"]
        assert offers["mixed"] is None and shapes == Shapes(mixed=False, spares=shapes.spares, elastic=shapes.elastic)
        assert (offers["spot"]["min_nodes"] < 8) == shapes.elastic
        assert offers["spot"]["spares"] == 0 or shapes.spares
        assert offers["recommended"] in path.read_text()  # the summary line names the pool it launches


def test_a_spot_trace_changes_the_recommendation_and_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without a trace spot is recommended and the manifest pins spot nodes; on a trace whose capacity never
    comes back, on demand is recommended and written."""
    argv = ["--model", "llama3-8b", "--gpus", "32", "--seq-len", "4096", "--global-batch", "256", "--train-tokens",
            "3e10", "--top", "1", "--preemption-rate", "0.05", "--preemption-per", "node-hour", "--replay-runs", "5",
            "--data-source", "/data", "--image", "i", "--emit", "kubernetes"]  # fmt: skip
    plain = tmp_path / "plain.json"
    assert run_plan(plan_args(*argv, "--emit-to", str(plain))) == 0
    assert "#1 recommended: spot" in capsys.readouterr().out
    scarce = tmp_path / "scarce.json"
    scarce.write_text(json.dumps({"metadata": {"gap_seconds": 300, "nodes": 4}, "data": [0] * 200}))
    traced = tmp_path / "traced.json"
    assert run_plan(plan_args(*argv, "--emit-to", str(traced), "--spot-trace", str(scarce))) == 0
    assert "#1 recommended on scarce.json: on demand" in capsys.readouterr().out
    pod = lambda p: json.loads(p.read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]  # noqa: E731
    assert "nodeSelector" in pod(plain) and "nodeSelector" not in pod(traced)


def test_emit_needs_an_image_a_data_source_and_says_where_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ("--model", "test", "--gpu", "cpu", "--gpus", "2")
    assert run_plan(plan_args(*base, "--emit", "kubernetes", "--data-source", "d")) == 2
    assert "--emit kubernetes needs --image" in capsys.readouterr().err
    assert run_plan(plan_args(*base, "--emit", "kubernetes", "--data-source", "d", "--image", "i",
                              "--spot-selector", "spot")) == 2  # fmt: skip
    assert "--spot-selector 'spot': expected a node label KEY=VALUE" in capsys.readouterr().err
    assert run_plan(plan_args(*base, "--emit", "slurm")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--emit slurm needs --data-source" in err
    target = two_node_cpu_plan(tmp_path)  # a --model config brings its data.source
    assert f"wrote {target}" in capsys.readouterr().err and os.access(target, os.X_OK)


def start_agents(script: Path, env: dict, train: list[str]) -> list[subprocess.Popen]:
    return [subprocess.Popen(["bash", str(script), *train], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True) for _ in range(2)]  # fmt: skip


def finish(agents: list[subprocess.Popen], timeout: float = 150) -> list[str]:
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for agent in agents:
            os.killpg(agent.pid, signal.SIGKILL)
        raise AssertionError(f"the two agents did not finish within {timeout} s") from None
    return outputs


def local_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The script's environment on a "node": the stand-ins first on PATH (a real Slurm's may be installed)."""
    venv = shims(tmp_path)
    return {
        **os.environ, "PATH": f"{venv / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "42", "MESHLM_VENV": str(venv), "RDZV_PORT": str(free_port()),
        "RDZV_ID": "emit-test", "RDZV_JOIN_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
        "MESHLM_RUN_DIR": str(tmp_path / "run"), **extra,
    }  # fmt: skip


def small_train(data_cache: str, steps: int) -> list[str]:
    return ["--data.max_chars", "1500000", "--data.cache_dir", data_cache, "--log.tensorboard", "false",
            "--train.eval_every", "0", "--log.every", "1", "--fault.watchdog_s", "60", "--parallel.timeout_s", "60",
            "--train.steps", str(steps), "--checkpoint.every", "2"]  # fmt: skip


@pytest.mark.slow  # two agents, a killed worker and a restarted group: ~20 s
def test_generated_sbatch_trains_as_two_nodes_and_resumes_after_a_node_dies(data_cache: str, tmp_path: Path) -> None:
    """rank 1 (the second node's only worker) SIGKILLs itself after step 5 (MESHLM_INJECT_FAULT, first attempt
    only); the agents restart the group, which resumes from the newest checkpoint and finishes with exit 0."""
    script = two_node_cpu_plan(tmp_path)
    text = script.read_text()
    assert "--nnodes=2:2 --nproc-per-node=1" in text and "--parallel.layout pp=1,dp=2,tp=1" in text
    assert "--data.source stdlib" in text  # the --model config's data source, passed through
    env = local_env(tmp_path, MESHLM_INJECT_FAULT="1:5:kill")
    agents = start_agents(script, env, small_train(data_cache, 8))
    outputs = finish(agents)
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-3000:]
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert records[0]["kind"] == "env" and records[0]["world_size"] == 2
    resume = next(r for r in records if r["kind"] == "resume")
    assert resume["step"] in (2, 4)  # step 4's async save may not have committed before the kill
    assert any(f"resuming from {run_dir}" in out for out in outputs)
    final = list_checkpoints(run_dir)[-1]
    assert final.name == "step_00000008" and read_trainer_state(final)["sampler"]["step"] == 8
    assert not (tmp_path / "requeued").exists()  # finished: nothing to requeue


def wait_for_training(metrics: Path, timeout: float = 900) -> None:
    """Until a training step is logged. The bound only ends a hung start (torchrun's rendezvous and the workers'
    imports take seconds quiet and minutes on a loaded 2-core machine): returning without a step would signal
    the pods before any worker started, where there is nothing to save."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
        assert time.monotonic() < deadline, f"no training step logged in {timeout:.0f} s ({metrics})"
        time.sleep(0.2)


@pytest.mark.slow  # two "pods" stopped by the kubelet's SIGTERM: ~15 s
def test_the_pytorchjob_command_saves_and_exits_143_on_the_kubelets_sigterm(data_cache: str, tmp_path: Path) -> None:
    """The manifest's container command and environment run as two pods: the rendezvous comes from the
    operator's PET_* variables; the kubelet signals only the container's main process (the agent), which must
    bring its workers to one save within terminationGracePeriodSeconds and exit 143 (the manifest's
    MESHLM_STOP_EXIT: steps are left, so the operator must restart it, not call it Succeeded)."""
    plan = two_node_cpu_plan(tmp_path)  # the same plan, as a manifest
    manifest = tmp_path / "job.json"
    config = tmp_path / "run.toml"
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(tmp_path / "cal.json"))
    assert run_plan(plan_args(*argv, "--top", "1", "--emit", "kubernetes", "--image", "i", "--emit-to",
                              str(manifest))) == 0  # fmt: skip
    job = json.loads(manifest.read_text())
    assert plan.exists() and job["spec"]["elasticPolicy"]["minReplicas"] == 2
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    command = [*command[: command.index("--log.run_dir")], "--log.run_dir", str(tmp_path / "run")]
    port = free_port()
    env = {**local_env(tmp_path), "PATH": f"{tmp_path / 'venv' / 'bin'}:{os.environ['PATH']}", "PET_NNODES": "2:2",
           "PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "PET_RDZV_ID": "k8s-test", "PET_MAX_RESTARTS": "3"}  # fmt: skip
    env |= {e["name"]: e["value"] for e in pod["containers"][0]["env"]}  # MESHLM_STOP_EXIT among them
    pods = [
        subprocess.Popen([*command, *small_train(data_cache, 400)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    wait_for_training(tmp_path / "run" / "metrics.jsonl")
    for p in pods:
        p.send_signal(signal.SIGTERM)  # the container's main process only
    started = time.monotonic()
    outputs = finish(pods)
    assert time.monotonic() - started < pod["terminationGracePeriodSeconds"]
    for p, out in zip(pods, outputs, strict=True):
        assert p.returncode == 143, out[-3000:]
    assert 0 < read_trainer_state(list_checkpoints(tmp_path / "run")[-1])["step"] < 400


def typed_round_trip(api: object, data: dict, klass: str) -> None:
    """`data` deserialises into the client's typed model `klass` (field types checked) and serialises back to
    itself: no field dropped or retyped."""
    model = api._ApiClient__deserialize(data, klass)  # type: ignore[attr-defined]
    assert api.sanitize_for_serialization(model) == data, klass  # type: ignore[attr-defined]


def test_the_pytorchjob_deserialises_into_the_kubernetes_and_kubeflow_typed_models() -> None:
    """The pod template and metadata into the kubernetes client's models (quantities are strings: an integer
    `nvidia.com/gpu` is refused), the PyTorchJob's own fields into the Kubeflow training SDK's."""
    k8s = pytest.importorskip("kubernetes.client")
    kubeflow = pytest.importorskip("kubeflow.training.api_client")
    api, sdk = k8s.ApiClient(), kubeflow.ApiClient()
    for launch in (LAUNCH, Launch("m", 2, 2, 0, 8, 3, (), gpu=False)):
        job = json.loads(kubernetes(launch, SITE, "registry/meshlm:1"))
        assert sorted(job) == ["apiVersion", "kind", "metadata", "spec"]
        typed_round_trip(api, job["metadata"], "V1ObjectMeta")
        spec = job["spec"]
        assert sorted(spec) == ["elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"]
        worker = spec["pytorchReplicaSpecs"]["Worker"]
        # the SDK leaves the pod template (a kubernetes model) to the kubernetes client
        replicas = {"Worker": {k: v for k, v in worker.items() if k != "template"}}
        typed_round_trip(sdk, spec | {"pytorchReplicaSpecs": replicas}, "KubeflowOrgV1PyTorchJobSpec")
        typed_round_trip(api, worker["template"], "V1PodTemplateSpec")
    # Kubernetes quantities are strings (an integer `nvidia.com/gpu`, what this file once wrote, is refused by
    # the clients that type-check it; kubernetes 35's deserializer lets it through, so check the file itself)
    template = json.loads(kubernetes(LAUNCH, SITE, "i"))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    for container in template["spec"]["containers"]:
        limits = container["resources"]["limits"]
        assert limits and all(isinstance(v, str) for v in limits.values()), limits


def test_no_file_has_a_path_of_the_planning_machine(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Neither this Python's environment nor this source tree appears in any file; without --install the Slurm
    and SkyPilot files are refused in one line."""
    base = ("--model", "test", "--gpu", "cpu", "--gpus", "2", "--data-source", "stdlib", "--top", "1")
    here = [sys.prefix, str(Path(__file__).resolve().parents[2]), str(Path(sys.executable).parent)]
    for target, extra in (("slurm", ()), ("kubernetes", ("--image", "i")), ("skypilot", ("--bucket", "s3://b"))):
        path = tmp_path / target
        flags = (*base, "--emit", target, "--emit-to", str(path), *extra)
        if target != "kubernetes":
            assert run_plan(plan_args(*flags)) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"--emit {target} needs --install" in err, err
            flags += ("--install", INSTALL)
        assert run_plan(plan_args(*flags)) == 0
        assert f"wrote {path}" in capsys.readouterr().err
        text = path.read_text()
        assert not [p for p in here if p in text], target
    assert run_plan(plan_args(*base, "--emit", "slurm", "--install", "not a requirement")) == 2
    assert "--install 'not a requirement': expected a pip requirement" in capsys.readouterr().err


# The searches' own first plans (an unconstrained search of 405B on 1,024 GPUs cost the fast tier 32 s), fixed:
# the grace is computed from whichever plan the launch is for.
GRACE_LAYOUTS = {
    "llama3-405b": Constraints(pp=32, dp=2, tp=4, cp=4, cp_attention="ring", zero=1, micro_batch=1,
                               schedule="interleaved", virtual_stages=3, recompute="none", sequence_parallel=True),
    "llama3-8b": Constraints(pp=1, dp=64, tp=1, cp=1, zero=3, micro_batch=1, schedule="1f1b", recompute="none"),
}  # fmt: skip


def test_grace_and_the_signal_lead_come_from_the_plans_checkpoint_time() -> None:
    """405B on 1,024 H100s: the checkpoint alone takes minutes at the planner's storage rate, so the grace,
    the sbatch warning and the pod's termination grace are all above it, and a small model gets less."""
    hw = hardware("H100-SXM")
    sizes = {}
    for name, gpus in (("llama3-405b", 1024), ("llama3-8b", 64)):
        w = Workload(PRESETS[name], 8192, 1024, 1e12, name=name)
        plan = search(w, gpus, hw, constraints=GRACE_LAYOUTS[name], priced=1).plans[0]
        launch = launch_for(plan, ["--model.preset", name], 8192, 1024, 1e12, name)
        checkpoint_s = plan.checkpoint_bytes / (DEFAULT_COSTS.storage_gbps * 1e9)
        args = list(launch.train_args)
        log_every = int(args[args.index("--log.every") + 1])  # where the loop notices SIGTERM: within a minute
        assert 1 <= log_every <= 10 and (log_every == 1 or log_every * plan.step.total <= 60)
        assert launch.grace_s == grace_for(log_every * plan.step.total, checkpoint_s) > 2 * checkpoint_s
        assert float(args[args.index("--fault.grace_s") + 1]) == launch.grace_s
        warn = int(sbatch_options(slurm(launch, SITE))["signal"].split("@")[1])
        pod = json.loads(kubernetes(launch, SITE, "i"))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        assert warn == pod["terminationGracePeriodSeconds"] > launch.grace_s
        sizes[name] = (checkpoint_s, launch.grace_s)
    assert sizes["llama3-405b"][0] > 120 and sizes["llama3-405b"][1] > sizes["llama3-8b"][1]


HOSTILE = "a b'c\"d\n$(touch {marker})`touch {marker}`;touch {marker}"


def test_user_values_cannot_inject_into_any_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Newlines, `$(...)`, backticks, quotes and spaces through every flag that reaches a file: Slurm names are
    refused in one line; every other value comes out of the script (run by bash up to `srun`, each value
    echoed back) and the YAML/JSON files (parsed) exactly as given, and nothing runs."""
    yaml = pytest.importorskip("yaml")
    marker = tmp_path / "ran"
    hostile = HOSTILE.format(marker=marker)
    base = ("--model", "test", "--gpu", "cpu", "--gpus", "2", "--top", "1", "--data-source", hostile)
    for flag in ("--partition", "--account"):
        assert run_plan(plan_args(*base, "--emit", "slurm", "--install", INSTALL, flag, hostile)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} " in err and "expected a Slurm name" in err, err
    wheel = f"/wheels/{hostile.replace(chr(10), ' ')}.whl"
    script_path = tmp_path / "job.sbatch"
    assert run_plan(plan_args(*base, "--emit", "slurm", "--install", wheel, "--run-dir", hostile, "--partition",
                              "gpu,debug", "--account", "proj-1.a_b", "--emit-to", str(script_path))) == 0  # fmt: skip
    script = script_path.read_text()
    assert "#SBATCH --partition=gpu,debug\n#SBATCH --account=proj-1.a_b\n" in script
    # Run it: `python3` (which makes the venv's `pip`), `pip`, `srun`, `scontrol` and `scancel` are stand-ins
    # that record their arguments.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("pip", "python3", "srun", "scontrol", "scancel"):
        record = f"#!/bin/bash\nprintf '{tool}\\0' >> {tmp_path}/calls\nprintf '%s\\0' \"$@\" >> {tmp_path}/calls\n"
        make_pip = f'mkdir -p "$3/bin" && cp {bin_dir}/pip "$3/bin/pip"\n' if tool == "python3" else ""
        (bin_dir / tool).write_text(record + make_pip)
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "HOME": str(tmp_path)}  # fmt: skip
    done = subprocess.run(["bash", str(script_path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    calls = (tmp_path / "calls").read_text().split("\0")
    assert not marker.exists(), (done.stdout, done.stderr)
    srun = calls[calls.index("srun") + 1 :]
    assert srun[srun.index("--data.source") + 1] == hostile and srun[srun.index("--log.run_dir") + 1] == hostile
    venv = calls[calls.index("python3") + 1 :]
    assert venv[:3] == ["-m", "venv", str(Path(hostile).parent / ".venv" / "meshlm")]
    assert calls[calls.index("pip") + 1 : calls.index("pip") + 4] == ["install", "--quiet", wheel]
    # The PyTorchJob (JSON) and the SkyPilot task (YAML): parsed, every value as given.
    manifest, task = tmp_path / "job.json", tmp_path / "job.sky.yaml"
    assert run_plan(plan_args(*base, "--emit", "kubernetes", "--image", hostile, "--pvc", hostile,
                              "--emit-to", str(manifest))) == 0  # fmt: skip
    job = json.loads(manifest.read_text())
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert pod["containers"][0]["image"] == hostile and command[command.index("--data.source") + 1] == hostile
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == hostile
    assert run_plan(plan_args(*base, "--emit", "skypilot", "--bucket", hostile, "--install", wheel,
                              "--emit-to", str(task))) == 0  # fmt: skip
    parsed = yaml.safe_load(task.read_text())
    assert parsed["envs"]["MESHLM_DATA"] == hostile and parsed["file_mounts"]["/meshlm-run"]["source"] == hostile
    mount = next(k for k in parsed["file_mounts"] if k.startswith("/meshlm-dist/"))
    assert parsed["file_mounts"][mount] == wheel and shlex.split(parsed["setup"]) == ["pip", "install", mount]
    assert not marker.exists()


def test_the_skypilot_task_is_yamllint_clean_and_parses_with_skypilot(tmp_path: Path) -> None:
    """yamllint (default rules; the `run` command's long lines allowed) finds nothing, and SkyPilot's own
    `Task.from_yaml` reads the task as written (where skypilot is installed: it is not a test dependency,
    its own pins conflict with the hf extra's)."""
    lint = pytest.importorskip("yamllint.linter")
    config = pytest.importorskip("yamllint.config")
    hw = hardware("H100-SXM")
    for pool, install in ((Pool(8, 8, spot=8), INSTALL), (Pool(8, 8), "/dist/meshlm-0.1.0-py3-none-any.whl")):
        launch = Launch("my model", 8, 8, 0, 8, 12, ("--model.preset", "llama3-8b"), summary="summary")
        text = skypilot(launch, Site("hf:org/corpus", install=install, bucket="s3://b/runs"), pool, hw)
        rules = config.YamlLintConfig("extends: default\nrules: {line-length: disable, document-start: disable}")
        assert [str(p) for p in lint.run(text, rules)] == []
        sky = pytest.importorskip("sky")
        path = tmp_path / "task.sky.yaml"
        path.write_text(text)
        task = sky.Task.from_yaml(str(path))
        assert task.name == "meshlm-my-model" and task.num_nodes == 8
        assert task.envs["MESHLM_DATA"] == "hf:org/corpus" and "meshlm launch" in task.run
        assert {r.accelerators["H100"] for r in task.resources} == {8}
        assert {r.use_spot for r in task.resources} == ({True, False} if pool.spot else {False})
        assert task.setup.strip() == (f"pip install {INSTALL}" if install == INSTALL else
                                      "pip install /meshlm-dist/meshlm-0.1.0-py3-none-any.whl")  # fmt: skip
