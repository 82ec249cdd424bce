"""`meshlm plan --emit slurm|kubernetes` (meshlm/plan/emit.py, docs/clusters.md): the launch files carry the
plan's layout, checkpoint interval, node range, spares and restarts, and the generated sbatch script really
trains: run as two "nodes" on localhost (two torchrun agents, each started by the script through a stand-in
`srun` and `scontrol`), the way tests/test_elastic.py runs agents."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port

from meshlm.checkpoint import list_checkpoints
from meshlm.model.config import PRESETS
from meshlm.plan import Workload, hardware, search
from meshlm.plan.cli import add_plan_parser, run_plan
from meshlm.plan.emit import Launch, kubernetes, launch_for, slurm

RUN_TOML = """[model]
preset = "test"

[data]
seq_len = 64

[train]
global_batch = 8
steps = 4
"""


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def two_node_cpu_plan(tmp_path: Path, *extra: str) -> Path:
    """Plan the `test` model on 2 cpu ranks, one per "node" (a calibration of 1 device per node)."""
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 1}))
    target = tmp_path / "job.sbatch"
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration))
    assert run_plan(plan_args(*argv, "--top", "1", "--emit", "slurm", "--emit-to", str(target), *extra)) == 0
    return target


def test_an_elastic_spot_plan_becomes_a_node_range_spares_and_a_dp_free_layout() -> None:
    """llama3-8b on 64 H100: spot, elastic down to one node, is recommended; the launch lets dp follow the
    world (`pp=1,tp=2`), ranges the agents over min:8 nodes and allows three times the expected restarts.
    (llama3-70b's pick on 64 H100 no longer shrinks to 4 nodes since the planner counts ZeRO-2's fp32
    master and gradient shards: 8.75B parameters per GPU at dp=4 need 6 bytes each, not 5.5.)"""
    w = Workload(PRESETS["llama3-8b"], 8192, 512, 1.4e12, name="llama3-8b")
    plan = search(w, 64, hardware("H100-SXM"), priced=1).plans[0]
    pool = plan.cost.pool
    assert pool.elastic and pool.spot == 8
    launch = launch_for(plan, ["--model.preset", "llama3-8b"], 8192, 512, 1.4e12, "llama3-8b")
    assert (launch.min_nodes, launch.nodes, launch.nproc_per_node) == (pool.min_nodes, 8, 8)
    assert launch.max_restarts >= 3 * plan.cost.restarts
    args = launch.torchrun_args("head:29500", "job")
    assert args[:4] == [f"--nnodes={pool.min_nodes}:8", "--nproc-per-node=8", f"--max-restarts={launch.max_restarts}",
                        "--rdzv-backend=c10d"]  # fmt: skip
    train = list(launch.train_args)
    assert train[train.index("--parallel.layout") + 1] == "pp=1,tp=2"
    steps = int(train[train.index("--train.steps") + 1])
    every = int(train[train.index("--checkpoint.every") + 1])
    assert steps == -(-1.4e12 // (512 * 8192)) and every == round(plan.cost.interval_s / plan.step.total)


def test_sbatch_and_pytorchjob_carry_the_same_trainer_command() -> None:
    launch = Launch("my model", 8, 4, 2, 8, 12, ("--model.preset", "llama3-8b", "--parallel.layout", "pp=1,tp=8"))
    script = slurm(launch, "summary")
    assert "#SBATCH --nodes=10\n" in script and "#SBATCH --gpus-per-node=8\n" in script  # 8 + 2 hot spares
    assert (
        "#SBATCH --job-name=meshlm-my-model\n" in script and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script
    )
    line = script.rstrip().splitlines()[-1]
    words = shlex.split(line.replace('"$HEAD_NODE:$RDZV_PORT"', "head:1").replace('"$RDZV_ID"', "id"))
    assert words[:3] == ["torchrun", "--nnodes=4:8", "--nproc-per-node=8"] and words[-1] == "$@"
    assert words[words.index("train") + 1 : -1] == list(launch.train_args)
    job = json.loads(kubernetes(launch, "summary", "registry/meshlm:1"))
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == "8"
    policy = job["spec"]["elasticPolicy"]
    assert (policy["rdzvBackend"], policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (
        "c10d", 4, 8, 12,
    )  # fmt: skip
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun", "-m", "meshlm.cli", "train", *launch.train_args]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    assert container["image"] == "registry/meshlm:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_emit_needs_an_image_for_kubernetes_and_says_where_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run_plan(plan_args("--model", "test", "--gpu", "cpu", "--gpus", "2", "--emit", "kubernetes")) == 2
    assert "--emit kubernetes needs --image" in capsys.readouterr().err
    target = two_node_cpu_plan(tmp_path)
    assert f"wrote {target}" in capsys.readouterr().err and os.access(target, os.X_OK)


@pytest.mark.slow  # two torchrun nodes: ~12 s
def test_generated_sbatch_trains_as_two_nodes_on_localhost(data_cache: str, tmp_path: Path) -> None:
    script = two_node_cpu_plan(tmp_path)
    text = script.read_text()
    assert "--nnodes=2:2 --nproc-per-node=1" in text and "--parallel.layout pp=1,dp=2,tp=1" in text
    shims = tmp_path / "bin"  # stand-ins for Slurm: srun runs its command here, scontrol names this host
    shims.mkdir()
    (shims / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    (shims / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    run_dir = tmp_path / "run"
    env = {
        **os.environ, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1",
        "RDZV_PORT": str(free_port()), "RDZV_ID": "emit-test", "RDZV_JOIN_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    train = ["--data.max_chars", "1500000", "--data.cache_dir", data_cache, "--log.run_dir", str(run_dir),
             "--log.progress", "false", "--log.tensorboard", "false", "--train.eval_every", "0", "--log.every", "1",
             "--fault.watchdog_s", "60", "--parallel.timeout_s", "60"]  # fmt: skip
    agents = [
        subprocess.Popen(
            ["bash", str(script), *train],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
        for agent in agents:
            os.killpg(agent.pid, signal.SIGKILL)
        raise AssertionError("the two agents did not finish within 120 s") from None
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-3000:]
    env_records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"env"' in line]
    assert env_records[0]["world_size"] == 2 and env_records[0]["layout"] == "pp=1,dp=2,tp=1"
    assert list_checkpoints(run_dir)[-1].name == "step_00000004"
