"""SIGTERM (a spot notice) to a committed checkpoint: how long the real `meshlm train` takes, on this machine,
for the tiny preset and a ~100M-parameter model, in one process and as two dp ranks under torchrun.

Each case starts `meshlm train` on a fresh run directory (no periodic checkpoints), waits until it has
logged a few steps, sends SIGTERM (to the process, or to torchrun's agent, which forwards it to every worker,
as a cloud's notice reaches a node), and polls the checkpoint folder every 10 ms. It reports the step time,
the checkpoint's size, the time from SIGTERM to the committed checkpoint (`step_N/` renamed into place with
its manifest: the rest of the step in flight, the all-ranks agreement, the save, the hashes, the commit),
the save alone as the trainer's metrics record it (staging + writing + hashing + commit), the time to the
process's exit, and what fraction of a 30 s and a 2 min notice the commit takes.

    .venv/bin/python benchmarks/preemption.py                # tiny and 100M, world 1 and 2: ~4 min on 2 cores
    .venv/bin/python benchmarks/preemption.py --cases tiny --worlds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshlm.model.config import ModelConfig
from meshlm.model.flops import param_counts

BIG = ModelConfig(vocab_size=8192, dim=768, n_layers=14, n_heads=12, n_kv_heads=4, intermediate_size=2048,
                  max_seq_len=256)  # fmt: skip
CASES = {
    "tiny": ["--model.preset", "tiny", "--data.seq_len", "128", "--train.global_batch", "8"],
    "100M": ["--model.preset", "small", *(x for k, v in BIG.to_dict().items() if k in ("vocab_size", "dim",
             "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len")
             for x in (f"--model.{k}", str(v))), "--data.seq_len", "128", "--train.global_batch", "4"],
}  # fmt: skip
NOTICES = (("30 s", 30.0), ("2 min", 120.0))


def committed(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "manifest.json").exists())


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


def one(case: str, world: int, cache: str, after_steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"preempt-{case}-"))
    args = [*CASES[case], "--train.steps", "10000", "--checkpoint.every", "0", "--log.run_dir", str(run_dir),
            "--log.every", "1", "--log.progress", "false", "--log.tensorboard", "false", "--train.eval_every", "0",
            "--data.cache_dir", cache, "--data.max_chars", "2000000", "--train.warmup_steps", "2"]  # fmt: skip
    if world == 1:
        cmd = [sys.executable, "-m", "meshlm.cli", "train", *args]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc-per-node={world}", "-m", "meshlm.cli", "train", *args,
               "--parallel.layout", f"dp={world}", "--parallel.zero", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while len(records(run_dir, "train")) < after_steps:
            if proc.poll() is not None:
                raise RuntimeError(f"{case} world {world} exited early:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.05)
        steps = records(run_dir, "train")
        step_s = steps[-1].get("step_time_s") or (steps[-1]["time"] - steps[-2]["time"])
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        commit_s = None
        while proc.poll() is None or commit_s is None:
            if commit_s is None and committed(run_dir):
                commit_s = time.monotonic() - start
            if proc.poll() is not None and commit_s is None:
                break
            time.sleep(0.01)
        exit_s = time.monotonic() - start
        out = proc.stdout.read()
        if commit_s is None and committed(run_dir):  # committed just before the exit
            commit_s = exit_s
        # torchrun's agent re-raises the signal after its workers exit (code 1); the workers must say they saved
        if commit_s is None or "SIGTERM: saved step" not in out:
            raise RuntimeError(f"{case} world {world}: no checkpoint after SIGTERM (exit {proc.returncode}):\n"
                               f"{out[-3000:]}")  # fmt: skip
        size = sum(f.stat().st_size for f in committed(run_dir)[-1].iterdir())
        save = records(run_dir, "checkpoint")[-1]  # the trainer's own timing of that save
        return {"case": case, "world": world, "step_s": step_s, "ckpt_mb": size / 2**20, "commit_s": commit_s,
                "save_s": save.get("held_s", 0.0) + save.get("write_s", 0.0), "exit_s": exit_s}  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--after-steps", type=int, default=3, help="steps logged before the SIGTERM")
    parser.add_argument("--cache", default=".cache/meshlm-bench", help="data cache (tokenized once per vocab)")
    a = parser.parse_args()
    print(f"100M case: {param_counts(BIG)['total'] / 1e6:.1f}M parameters; fp32 weights + AdamW moments")
    header = ["model", "world", "step s", "checkpoint MiB", "save s", "SIGTERM→commit s", "SIGTERM→exit s"]
    header += [f"commit / {name} notice" for name, _ in NOTICES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for case in a.cases:
        for world in a.worlds:
            r = one(case, world, a.cache, a.after_steps)
            cells = [case, str(world), f"{r['step_s']:.2f}", f"{r['ckpt_mb']:.0f}", f"{r['save_s']:.2f}",
                     f"{r['commit_s']:.2f}",
                     f"{r['exit_s']:.2f}", *(f"{r['commit_s'] / s:.1%}" for _, s in NOTICES)]  # fmt: skip
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
