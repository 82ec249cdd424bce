"""`meshlm plan --emit ... --check` (meshlm/plan/emit.py, docs/clusters.md, docs/check.md): each launch file runs
`meshlm check` with the run's own config and overrides on one node before any training, and a failing check
stops the job with one line (on Slurm without a requeue). Without --check every file is unchanged.

The files run here as written (bash for the sbatch script and SkyPilot's setup, dash for the PyTorchJob's
container command) with a stand-in `meshlm` on PATH that records its arguments and exits as `meshlm check`
does (0 passed, 1 a check failed) or as `meshlm launch` after training (0); Slurm's `srun` and `scontrol` are
tests/integration/test_plan_emit.py's stand-ins. The arguments the check gets are read by meshlm's own CLI into the same
Config the training gets. The real `meshlm check` refusing an override stops the sbatch script, and (slow)
passing on two cpu ranks lets the run train."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_plan_emit import (
    INSTALL,
    LAUNCH,
    RUN_TOML,
    SITE,
    local_env,
    plan_args,
    shims,
    small_train,
    two_node_cpu_plan,
    typed_round_trip,
)
from test_plan_skypilot import block

from meshlm.cli import build_parser, cmd_check, cmd_train
from meshlm.config import load_config, parse_overrides
from meshlm.plan import hardware
from meshlm.plan.cli import run_plan
from meshlm.plan.emit import RUN_MOUNT, Site, skypilot, slurm
from meshlm.plan.emit_k8s import kubernetes
from meshlm.plan.spot import Pool

CHECKED = Site(SITE.data_source, install=INSTALL, time_limit_s=SITE.time_limit_s, check=True)
FAILED = "meshlm: meshlm check failed (exit 1; its report is above): not training"


def recorder(bin_dir: Path, calls: Path) -> None:
    """`meshlm` that appends its arguments (NUL-separated, one call per record) to `calls` and exits as the real
    one: `check` with CHECK_EXIT (0 passed, 1 failed), anything else (`launch`, after training) with 0."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "meshlm").write_text(f"#!/bin/sh\n{{ printf '%s\\0' \"$@\"; printf '\\n'; }} >> {calls}\n"
                                    'if [ "$1" = check ]; then exit "${CHECK_EXIT:-0}"; fi\n')  # fmt: skip
    (bin_dir / "meshlm").chmod(0o755)


def recorded(calls: Path) -> list[list[str]]:
    if not calls.exists():
        return []
    return [record.split("\0") for record in calls.read_text().split("\0\n")[:-1]]


def config_of(argv: list[str]) -> tuple[object, dict]:
    """What meshlm's own CLI makes of `argv`: the command and the run's Config (log.run_dir left out: the check
    keeps its runs in its own work directory)."""
    args, extra = build_parser().parse_known_args(argv)
    config = load_config(args.config, parse_overrides(extra)).model_dump()
    config["log"].pop("run_dir")
    return args, config


def test_check_is_off_by_default_and_only_adds_its_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--check adds the check and changes nothing else: the sbatch script and SkyPilot's task gain lines (and
    the task's install stops the setup when it fails); the PyTorchJob's container command becomes a script
    that ends by exec-ing the unchanged command. Without it the planner writes what `slurm`, `kubernetes` and
    `skypilot` write for a Site without check (tests/integration/test_plan_emit.py checks those files)."""
    plain, checked = slurm(LAUNCH, SITE), slurm(LAUNCH, CHECKED)
    ops = difflib.SequenceMatcher(None, plain.splitlines(), checked.splitlines(), autojunk=False).get_opcodes()
    assert [op for op, *_ in ops if op != "equal"] == ["insert"]
    hw, pool = hardware("H100-SXM"), Pool(8, 8, spot=8)
    sky_site = Site("hf:org/corpus", install=INSTALL, bucket="s3://b")
    plain = skypilot(LAUNCH, sky_site, pool, hw).splitlines()
    checked = skypilot(LAUNCH, Site(**{**vars(sky_site), "check": True}), pool, hw).splitlines()
    ops = difflib.SequenceMatcher(None, plain, checked, autojunk=False).get_opcodes()
    removed = [line for op, i1, i2, _, _ in ops if op != "equal" for line in plain[i1:i2]]
    added = [line for op, _, _, j1, j2 in ops if op != "equal" for line in checked[j1:j2]]
    assert removed == [f"  pip install {INSTALL}"] and added[0] == f"  pip install {INSTALL} || exit"
    plain_job, checked_job = json.loads(kubernetes(LAUNCH, SITE, "i")), json.loads(kubernetes(LAUNCH, CHECKED, "i"))
    container = lambda job: job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]  # noqa: E731
    command, script = container(plain_job)["command"], container(checked_job)["command"]
    assert script[:2] == ["sh", "-c"] and script[2].endswith(f"\nexec {' '.join(command)}\n")
    container(checked_job)["command"] = command
    assert checked_job == plain_job
    # through the planner: --check needs --emit; without --check the file is the one written without it
    base = ("--model", "test", "--gpu", "cpu", "--gpus", "2", "--data-source", "stdlib", "--top", "1")
    assert run_plan(plan_args(*base, "--check")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--check goes into a launch file: it needs --emit" in err
    for check in ((), ("--check",)):
        path = tmp_path / f"job{len(check)}.sbatch"
        assert run_plan(plan_args(*base, "--emit", "slurm", "--install", INSTALL, "--emit-to", str(path), *check)) == 0
    capsys.readouterr()
    assert "meshlm check" not in (tmp_path / "job0.sbatch").read_text()
    assert "meshlm_check --world 2 " in (tmp_path / "job1.sbatch").read_text()


def run_sbatch(script: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    environment = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1",
                   "SLURM_JOB_ID": "42", "MESHLM_VENV": str(venv), "MESHLM_RUN_DIR": str(tmp_path / "run"),
                   **env}  # fmt: skip
    return subprocess.run(["bash", str(script), *args], env=environment, capture_output=True, text=True, timeout=120)


def test_the_sbatch_script_checks_the_runs_own_config_once_and_a_failure_stops_it(tmp_path: Path) -> None:
    """The script's check gets exactly the run's config and overrides (read by meshlm's CLI), and the plan's
    world; a failed check starts no training, asks for no requeue and says so in one line; a passed check is
    not run again for the same arguments (a requeued job), but is for new ones."""
    script = two_node_cpu_plan(tmp_path, "--check")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shims(tmp_path)  # srun, scontrol (recording requeues) and an installed MESHLM_VENV ...
    calls = tmp_path / "calls"
    recorder(tmp_path / "venv" / "bin", calls)  # ... whose meshlm is the recorder
    failed = run_sbatch(script, tmp_path, CHECK_EXIT="1")
    assert failed.returncode == 1 and failed.stderr == FAILED + ", not requeueing job 42\n", failed.stderr
    assert [call[0] for call in recorded(calls)] == ["check"] and not (tmp_path / "requeued").exists()
    calls.unlink()
    passed = run_sbatch(script, tmp_path)
    assert passed.returncode == 0, passed.stderr
    check, launch = recorded(calls)
    assert check[0] == "check" and launch[0] == "launch"
    check_args, check_config = config_of(check)
    train_args, train_config = config_of(launch[launch.index("train") :])
    assert check_args.func is cmd_check and train_args.func is cmd_train and check_args.world == 2
    assert check_args.workdir == str(tmp_path / "run" / "check")
    assert check_config == train_config and check_config["data"]["source"] == "stdlib"
    calls.unlink()
    again = run_sbatch(script, tmp_path)
    assert again.returncode == 0 and "meshlm check passed before with these arguments" in again.stdout
    assert [call[0] for call in recorded(calls)] == ["launch"]
    calls.unlink()
    changed = run_sbatch(script, tmp_path, "--train.steps", "3")
    assert changed.returncode == 0, changed.stderr
    check, launch = recorded(calls)
    assert check[-2:] == launch[-2:] == ["--train.steps", "3"]
    assert config_of(check)[1]["train"]["steps"] == 3


def test_the_sbatch_script_stops_on_the_real_check_refusing_the_run(tmp_path: Path) -> None:
    """The real `meshlm check`, given an override that the run's layout cannot hold, refuses it in one line
    (exit 2); the script starts no training and asks for no requeue."""
    script = two_node_cpu_plan(tmp_path, "--check")
    shims(tmp_path)  # meshlm is this worktree's CLI; srun records nothing but runs what it is given
    srun = tmp_path / "venv" / "bin" / "srun"
    srun.write_text(f"#!/bin/sh\ntouch {tmp_path}/trained\n")
    done = run_sbatch(script, tmp_path, "--train.global_batch", "3")  # dp=2 cannot split 3 sequences
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and lines[-1] == "meshlm: meshlm check failed (exit 2; its report is above): not " \
        "training, not requeueing job 42", done.stderr  # fmt: skip
    assert lines[-2].startswith("meshlm: ") and "global_batch" in lines[-2]
    assert not (tmp_path / "trained").exists() and not (tmp_path / "requeued").exists()


@pytest.mark.slow  # the real check (three runs of the `test` model's replica at 1 and 2 ranks), then training: ~40 s
def test_the_sbatch_script_trains_after_the_real_check_passes(data_cache: str, tmp_path: Path) -> None:
    """One node of two cpu ranks: the real `meshlm check` passes on the run's own config (and the overrides
    given to the script), leaves .check-passed, and the script's `meshlm launch` trains the run to its end."""
    config, calibration = tmp_path / "run.toml", tmp_path / "cal.json"
    config.write_text(RUN_TOML)
    calibration.write_text(json.dumps({"device": "cpu", "gpus_per_node": 2}))
    script = tmp_path / "job.sbatch"
    assert run_plan(plan_args("--model", str(config), "--gpu", "cpu", "--gpus", "2", "--calibration", str(calibration),
                              "--top", "1", "--emit", "slurm", "--emit-to", str(script), "--install", INSTALL,
                              "--check")) == 0  # fmt: skip
    env = local_env(tmp_path)
    done = subprocess.run(["bash", str(script), *small_train(data_cache, 4)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "PASS: the layout reproduces one process" in done.stdout
    run_dir = tmp_path / "run"
    assert (run_dir / ".check-passed").is_file() and (run_dir / "check" / "layout").is_dir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records if r["kind"] == "train"][-1] == 4


def pod(script: str, name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["dash", "-c", script], env={**env, "HOSTNAME": name}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash (a POSIX sh that is not bash)")
def test_the_pytorchjob_checks_on_the_first_worker_and_the_others_wait(tmp_path: Path) -> None:
    """The container command as two pods: the rendezvous host (PET_RDZV_ENDPOINT's, as the training operator
    names it) checks; the other waits for its verdict on the shared claim. After a pass both exec
    `meshlm launch`; after a failure neither does, each says so in one line, and a restarted pod does not
    check again."""
    api = pytest.importorskip("kubernetes.client").ApiClient()
    job = json.loads(kubernetes(LAUNCH, CHECKED, "registry/meshlm:1"))
    typed_round_trip(api, job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"], "V1PodTemplateSpec")
    sh, _, script = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert subprocess.run([sh, "-n", "-c", script]).returncode == 0
    for verdict in ("passed", "failed"):
        mount, calls = tmp_path / verdict, tmp_path / f"{verdict}.calls"
        recorder(tmp_path / "bin", calls)
        text = script.replace(RUN_MOUNT, str(mount))  # the claim's mount point, here
        env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "PET_RDZV_ENDPOINT": "meshlm-my-model-worker-0:23456",
               "TMPDIR": str(tmp_path), "CHECK_EXIT": "0" if verdict == "passed" else "1"}  # fmt: skip
        (tmp_path / verdict / "w1").mkdir(parents=True)  # the second worker starts first and waits
        second = pod(text, "meshlm-my-model-worker-1", env | {"TMPDIR": str(tmp_path / verdict / "w1")})
        assert second.stdout.readline() == "meshlm: waiting for meshlm check on the first worker\n"
        first = pod(text, "meshlm-my-model-worker-0", env)
        _, err = first.communicate(timeout=60)
        _, err2 = second.communicate(timeout=60)
        names = [call[0] for call in recorded(calls)]
        if verdict == "passed":
            assert first.returncode == second.returncode == 0, (err, err2)
            assert names == ["check", "launch", "launch"]  # one check, then both agents
            check = recorded(calls)[0]
            assert check[check.index("--world") + 1] == "64" and "--log.run_dir" not in check
        else:
            assert first.returncode == 1 and err == FAILED + "\n", err
            assert second.returncode == 1 and err2 == "meshlm: meshlm check failed on the first worker: " \
                "not training\n", err2  # fmt: skip
            assert names == ["check"]
            restarted = pod(text, "meshlm-my-model-worker-0", env)
            _, err3 = restarted.communicate(timeout=60)
            assert restarted.returncode == 1 and err3.count("\n") == 1 and "failed before" in err3
            assert names == [call[0] for call in recorded(calls)]  # not checked again


def test_the_skypilot_setup_checks_on_the_first_node_and_a_failure_ends_the_setup(tmp_path: Path) -> None:
    """The setup (which SkyPilot runs on every node before `run` starts on any) installs meshlm, then the first
    node checks with the run's arguments and MESHLM_TRAIN_ARGS; the others do not. A failure ends the setup
    with one line."""
    lint = pytest.importorskip("yamllint.linter")
    config = pytest.importorskip("yamllint.config")
    yaml = pytest.importorskip("yaml")
    site = Site("hf:org/corpus", install=INSTALL, bucket="s3://b", check=True)
    text = skypilot(LAUNCH, site, Pool(8, 8), hardware("H100-SXM"))
    rules = config.YamlLintConfig("extends: default\nrules: {line-length: disable, document-start: disable}")
    assert [str(p) for p in lint.run(text, rules)] == []
    task = yaml.safe_load(text)
    setup = block(text, "setup")
    assert task["setup"] == setup
    calls = tmp_path / "calls"
    recorder(tmp_path / "bin", calls)
    (tmp_path / "bin" / "pip").write_text(f"#!/bin/sh\necho pip >> {tmp_path}/pip\n")
    (tmp_path / "bin" / "pip").chmod(0o755)
    env = {**task["envs"], "MESHLM_RUN_DIR": str(tmp_path / "run"), "MESHLM_TRAIN_ARGS": "--train.steps 3",
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}  # fmt: skip
    for rank, exit_code in (("1", "0"), ("0", "1"), ("0", "0")):
        done = subprocess.run(["bash", "-c", setup], env={**env, "SKYPILOT_SETUP_NODE_RANK": rank,
                              "CHECK_EXIT": exit_code}, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == int(exit_code) and (tmp_path / "pip").read_text().count("pip") >= 1
        checks = recorded(calls)
        if rank == "1":
            assert checks == []
            continue
        assert done.stderr == (FAILED + "\n" if exit_code == "1" else ""), done.stderr
        check = checks[-1]
        assert check[-4:] == ["--data.cache_dir", task["envs"]["MESHLM_CACHE_DIR"], "--train.steps", "3"]
        assert check[check.index("--data.source") + 1] == "hf:org/corpus" and check[:3] == ["check", "--world", "64"]
    assert len(recorded(calls)) == 2  # one failed check, one passed
