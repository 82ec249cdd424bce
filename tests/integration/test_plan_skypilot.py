"""`meshlm plan --emit skypilot` (meshlm/plan/emit.py, docs/clusters.md): the task YAML carries the layout,
node count, spot with an on-demand fallback, bounded job recovery, the bucket in MOUNT_CACHED mode and the
install step, and its `run` command really trains: run as two "nodes" on localhost with SkyPilot's node
variables set, one node's worker killed mid-run (MESHLM_INJECT_FAULT: rank 1, the second node's only worker,
SIGKILLs itself after step 5), the agents restart the group, which resumes from the newest valid checkpoint
at the same data position. `meshlm` is this worktree's CLI (tests/integration/test_plan_emit.py's `shims`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port
from test_plan_emit import INSTALL, RUN_TOML, plan_args, shims

from meshlm.checkpoint import list_checkpoints
from meshlm.checkpoint.store import read_trainer_state
from meshlm.plan import hardware
from meshlm.plan.cli import run_plan
from meshlm.plan.emit import Launch, Site, skypilot
from meshlm.plan.spot import Pool

LAUNCH = Launch("my model", 8, 8, 0, 8, 12, ("--model.preset", "llama3-8b", "--parallel.layout", "pp=1,dp=8,tp=8"),
                summary="summary")  # fmt: skip


def site(bucket: str = "s3://bucket/runs", install: str = INSTALL) -> Site:
    return Site("hf:org/corpus", install=install, bucket=bucket)


def block(text: str, key: str) -> str:
    """The literal block `key: |` of the emitted YAML, dedented (what SkyPilot runs)."""
    lines = text.splitlines()
    start = lines.index(f"{key}: |") + 1
    body = []
    for line in lines[start:]:
        if line and not line.startswith("  "):
            break
        body.append(line[2:])
    return "\n".join(body) + "\n"


def parse(text: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(text)


def test_task_yaml_has_spot_with_on_demand_fallback_recovery_the_bucket_and_an_install(tmp_path: Path) -> None:
    task = parse(skypilot(LAUNCH, site(), Pool(8, 8, spot=8), hardware("H100-SXM")))
    assert task["name"] == "meshlm-my-model" and task["num_nodes"] == 8
    res = task["resources"]
    assert res["accelerators"] == "H100:8" and res["any_of"] == [{"use_spot": True}, {"use_spot": False}]
    # a crash that repeats is not relaunched 1,600 times; preemptions, and a run a signal stopped (exit 143), do
    # not count against it
    assert res["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3,
                                   "recover_on_exit_codes": [143]}  # fmt: skip
    assert task["file_mounts"] == {"/meshlm-run": {"source": "s3://bucket/runs", "mode": "MOUNT_CACHED"}}
    envs = task["envs"]
    assert envs["MESHLM_RUN_DIR"] == "/meshlm-run/meshlm-my-model" and envs["MESHLM_PORT"] == "29500"
    assert envs["MESHLM_CACHE_DIR"].startswith("/meshlm-run/") and envs["MESHLM_DATA"] == "hf:org/corpus"
    assert "workdir" not in task and task["setup"].strip() == "pip install meshlm==0.1.0"  # what --install names
    wheel = tmp_path / "meshlm-0.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    wheeled = parse(skypilot(LAUNCH, site(install=str(wheel)), Pool(8, 8), hardware("H100-SXM")))
    assert wheeled["file_mounts"]["/meshlm-dist/" + wheel.name] == str(wheel) and "workdir" not in wheeled
    assert wheeled["setup"].strip() == f"pip install /meshlm-dist/{wheel.name}"
    run = task["run"]
    assert run == block(skypilot(LAUNCH, site("s3://b"), Pool(8, 8, spot=8), hardware("H100-SXM")), "run")
    for variable in ("SKYPILOT_TASK_ID", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert f"${variable}" in run or f"${{{variable}" in run
    assert "meshlm launch --nnodes=" in run and "--max-restarts=12" in run
    assert "-m meshlm.cli train --model.preset llama3-8b --parallel.layout pp=1,dp=8,tp=8" in run
    assert '--data.source "$MESHLM_DATA" --data.cache_dir "$MESHLM_CACHE_DIR"' in run
    on_demand = parse(skypilot(LAUNCH, site("gs://b"), Pool(8, 8), hardware("A100-80GB")))["resources"]
    assert on_demand["use_spot"] is False and "any_of" not in on_demand and on_demand["accelerators"] == "A100-80GB:8"


def test_emit_skypilot_needs_a_bucket(capsys: pytest.CaptureFixture) -> None:
    assert run_plan(plan_args("--model", "test", "--gpu", "cpu", "--gpus", "2", "--emit", "skypilot",
                              "--data-source", "stdlib")) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--emit skypilot needs --bucket" in err


def run_nodes(run: Path, env: dict[str, str], fault: str = "") -> list[tuple[int, str]]:
    """The task's run script as two local nodes, SkyPilot's variables set; (exit code, output) per node."""
    nodes = []
    for rank in range(2):
        node_env = {**env, "SKYPILOT_NODE_RANK": str(rank), "MESHLM_PORT": env["MESHLM_PORT"]}
        if fault:
            node_env["MESHLM_INJECT_FAULT"] = fault
        nodes.append(subprocess.Popen(["bash", str(run)], env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)
        raise AssertionError("the two nodes did not finish within 120 s") from None
    return [(node.returncode, out) for node, out in zip(nodes, outputs, strict=True)]


def train_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow  # two agents, a killed worker and a restarted group: ~20 s
def test_run_command_trains_as_two_nodes_and_resumes_after_one_is_killed(data_cache: str, tmp_path: Path) -> None:
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 1}))
    target = tmp_path / "job.sky.yaml"
    argv = ("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration), "--top", "1")
    assert run_plan(plan_args(*argv, "--emit", "skypilot", "--emit-to", str(target), "--bucket", "s3://b/r",
                              "--install", INSTALL)) == 0  # fmt: skip
    text = target.read_text()
    assert "num_nodes: 2\n" in text and "accelerators" not in text  # cpu: no accelerators
    run = tmp_path / "run.sh"
    run.write_text(block(text, "run"))
    run_dir = tmp_path / "run"
    train = ["--train.steps", "8", "--checkpoint.every", "2", "--data.max_chars", "1500000", "--data.cache_dir",
             data_cache, "--log.progress", "false", "--log.tensorboard", "false", "--train.eval_every", "0",
             "--log.every", "1", "--fault.watchdog_s", "30", "--parallel.timeout_s", "30"]  # fmt: skip
    venv = shims(tmp_path)  # `meshlm` (and `meshlm launch`) of this worktree
    env = {
        **os.environ, "PATH": f"{venv / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1", "MESHLM_DATA": "stdlib", "MESHLM_CACHE_DIR": data_cache,
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "1",
        "MESHLM_RUN_DIR": str(run_dir), "MESHLM_PORT": str(free_port()), "MESHLM_TRAIN_ARGS": " ".join(train),
    }  # fmt: skip
    nodes = run_nodes(run, env, fault="1:5:kill")
    for code, out in nodes:
        assert code == 0, out[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cut = next(i for i, r in enumerate(records) if r["kind"] == "resume")
    before, step = train_losses(records[:cut]), records[cut]["step"]
    assert step in (2, 4) and max(before) == 5  # step 4's async save may not have committed before the kill
    # Rank 0 says it, on whichever node the c10d rendezvous made node rank 0 (join order, not SKYPILOT_NODE_RANK).
    assert any(f"resuming from {run_dir}" in out and f"at step {step}" in out for _, out in nodes), nodes
    after = train_losses(records[cut:])
    assert sorted(after) == list(range(step + 1, 9))
    for s in range(step + 1, 6):  # same weights and same batches: the redone steps' losses are identical
        assert after[s] == before[s], (s, after[s], before[s])
    final = list_checkpoints(run_dir)[-1]
    assert final.name == "step_00000008" and read_trainer_state(final)["sampler"]["step"] == 8
