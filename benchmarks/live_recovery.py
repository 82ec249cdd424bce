"""Live recovery (fault-tolerant replica groups) against a whole-job restart from the last checkpoint, on this
machine, in one run: the real `meshlm lighthouse` and `meshlm train` / `meshlm launch` processes.

live     `--groups` replica groups of one rank each (fault.replica_groups), joined by a lighthouse (heartbeat 5 s,
         join 3 s) with the collective timeout 10 s. At step `--kill-at` the last group is killed (SIGKILL) and
         relaunched at once, as a scheduler would. Measured from the kill: the survivors' quorum without it
         (detection), their first committed step, and the quorum at full strength again (after the relaunched
         group's start-up and its heal from a live peer).
restart  the same run as ONE job (`meshlm launch`, `--groups` dp ranks, torchrun inside, no replica groups),
         checkpointing every `--every` steps: killed (SIGKILL to the launcher and its workers) at the same step
         and relaunched at once; it resumes from its last checkpoint. Measured from the kill: its first committed
         step, and when it is back at the step it had reached (full strength: the steps since the checkpoint
         are trained again). "steps trained again": the live run redoes the one step in flight at the kill.

Prints a markdown table. The data cache is filled before any timing (`meshlm prepare-data`).

    .venv/bin/python benchmarks/live_recovery.py                    # 2 groups, tiny preset: ~2 min on 2 cores
    .venv/bin/python benchmarks/live_recovery.py --groups 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if record["kind"] == kind:
            found.append(record)
    return found


def wait_for(check: object, what: str, timeout: float = 600.0) -> object:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"live_recovery: timed out waiting for {what}")
        time.sleep(0.02)
    return found


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for each in tree:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(each, signal.SIGKILL)


def newest_step(metrics: Path) -> int:
    return max((r["step"] for r in records(metrics, "train")), default=0)


def live(args: argparse.Namespace, common: list[str], work: Path) -> dict[str, float]:
    port, run_dir = free_port(), work / "live"
    cmd = [sys.executable, "-m", "meshlm.cli", "lighthouse", "--port", str(port), "--join-timeout-s", "3",
           "--heartbeat-timeout-s", "5"]  # fmt: skip
    log = (work / "live.log").open("a")
    lighthouse = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT)
    train = [sys.executable, "-m", "meshlm.cli", "train", *common, "--log.run_dir", str(run_dir),
             "--fault.replica_groups", str(args.groups), "--fault.lighthouse", f"localhost:{port}",
             "--fault.collective_timeout_s", "10", "--fault.quorum_timeout_s", "60"]  # fmt: skip

    def group(g: int) -> subprocess.Popen:
        group_env = env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()), MESHLM_REPLICA_GROUP=str(g))  # fmt: skip
        return subprocess.Popen(train, env=group_env, stdout=log, stderr=subprocess.STDOUT)

    groups = [group(g) for g in range(args.groups)]
    last, first = args.groups - 1, run_dir / "group-0" / "metrics.jsonl"
    try:
        wait_for(lambda: newest_step(run_dir / f"group-{last}" / "metrics.jsonl") >= args.kill_at, "the kill step")
        groups[last].send_signal(signal.SIGKILL)
        killed = time.time()
        groups[last].wait()
        groups[last] = group(last)

        def after(kind: str, test: object) -> list[dict]:
            return [r for r in records(first, kind) if r["time"] > killed and test(r)]

        left = wait_for(lambda: after("replicas", lambda r: r["live_groups"] < args.groups), "the survivors' quorum")
        committed = wait_for(lambda: after("train", lambda r: True), "a committed step")
        full = wait_for(lambda: after("replicas", lambda r: r["live_groups"] == args.groups), "the full quorum")
    finally:
        for proc in [*groups, lighthouse]:
            proc.kill()
            proc.wait()
    return {"detect": left[0]["time"] - killed, "first": committed[0]["time"] - killed,
            "full": full[0]["time"] - killed, "redone": 1}  # fmt: skip


def restart(args: argparse.Namespace, common: list[str], work: Path) -> dict[str, float]:
    run_dir = work / "restart"
    cmd = [sys.executable, "-m", "meshlm.cli", "launch", "--standalone", "--nproc-per-node", str(args.groups),
           "--max-restarts", "0", "-m", "meshlm.cli", "train", *common, "--log.run_dir", str(run_dir)]  # fmt: skip
    log = (work / "restart.log").open("a")
    metrics = run_dir / "metrics.jsonl"
    job = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: newest_step(metrics) >= args.kill_at, "the kill step")
        reached = newest_step(metrics)
        kill_tree(job.pid)  # the launcher and every worker: a lost node takes the job down
        killed = time.time()
        job.wait()
        job = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT)
        after = lambda test: [r for r in records(metrics, "train") if r["time"] > killed and test(r)]  # noqa: E731
        first = wait_for(lambda: after(lambda r: True), "the restarted job's first step")
        back = wait_for(lambda: after(lambda r: r["step"] >= reached), "the step it had reached")
    finally:
        kill_tree(job.pid)
        job.wait()
    return {"detect": float("nan"), "first": first[0]["time"] - killed, "full": back[0]["time"] - killed,
            "redone": reached - (first[0]["step"] - 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups (and the restarted job's dp ranks)")
    parser.add_argument("--kill-at", type=int, default=30, help="the step at which the group (job) is killed")
    parser.add_argument("--every", type=int, default=20, help="checkpoint interval of both runs, in steps")
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="live-recovery-") as tmp:
        work = Path(tmp)
        data = ["--data.max_chars", "1500000", "--data.cache_dir", str(work / "cache"), "--data.seq_len", "128"]
        subprocess.run([sys.executable, "-m", "meshlm.cli", "prepare-data", "--workers", "1", "--model.preset",
                        args.preset, *data], env=env(), check=True, capture_output=True)  # fmt: skip
        common = ["--model.preset", args.preset, *data, "--train.global_batch", str(2 * args.groups),
                  "--train.steps", "100000", "--checkpoint.every", str(args.every), "--train.eval_every", "0",
                  "--log.every", "1", "--log.progress", "false", "--log.tensorboard", "false"]  # fmt: skip
        rows = {"live recovery (replica groups)": live(args, common, work),
                "whole-job restart from the last checkpoint": restart(args, common, work)}  # fmt: skip
    load = os.getloadavg()[0]
    print(f"\n{args.groups} groups (or dp ranks) of the {args.preset} preset, killed at step {args.kill_at}, "
          f"checkpoint every {args.every}; load average {load:.1f}\n")  # fmt: skip
    print("| recovery | kill → quorum without it | kill → first committed step | kill → full strength | steps "
          "trained again |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        detect = "—" if r["detect"] != r["detect"] else f"{r['detect']:.1f} s"
        print(f"| {name} | {detect} | {r['first']:.1f} s | {r['full']:.1f} s | {r['redone']} |")


if __name__ == "__main__":
    main()
