"""Randomized soak (issues #14, #32): the real `meshlm train`, run again and again on one run directory, each time
killed with SIGKILL after a random step or halfway through a save, or stopped with SIGTERM the ways schedulers
send it (once, twice in a row, at a random moment of start-up or training, during a background save, to
`meshlm launch`'s agent and its worker together), sometimes after the newest checkpoint was corrupted.
After every run the next one must resume from the newest valid checkpoint
(leftover staging folders removed, corrupt ones moved aside), and the run, once finished, must hold the same
weights as an uninterrupted run, bit for bit. Seeded, so a failure replays."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from run_args import small_run_args

from meshlm.checkpoint import latest_valid_checkpoint, list_checkpoints, load_model_state
from meshlm.config import load_config, parse_overrides
from meshlm.train.trainer import train

SEED = 14
STEPS = 8
EVERY = 2
FILES = ("__0_0.distcp", ".metadata", "trainer.json")  # each checked by its sha256 in the manifest


@contextmanager
def _one_thread() -> Iterator[None]:
    """In-process runs use one thread like the subprocesses (fast on a busy machine, and the same arithmetic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _newest_valid_step(run_dir: Path) -> int:
    path = latest_valid_checkpoint(run_dir, warn=lambda _message: None)
    return int(path.name.removeprefix("step_")) if path else 0


def _corrupt(path: Path, rng: random.Random) -> None:
    file = path / rng.choice(FILES)
    data = bytearray(file.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(data))


def _train_process(args: list[str], fault: str, launch: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHLM_INJECT_FAULT": fault, "OMP_NUM_THREADS": "1"}
    launcher = ["launch", "--standalone", "--nproc-per-node", "1", "-m", "meshlm.cli"] if launch else []
    command = [sys.executable, "-m", "meshlm.cli", *launcher, "train", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sigterm_after_a_step(proc: subprocess.Popen, metrics: Path, offset: int, times: int = 1) -> None:
    """SIGTERM (`times` in a row) once this run has logged a step (a spot notice mid-training)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and '"kind": "train"' in metrics.read_text()[offset:]:
            for _ in range(times):
                proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.05)


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler yet (its first lines install one; before them, while the
    interpreter itself starts, nothing can catch it)."""
    try:
        caught = next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt")
        )
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _sigterm_after(proc: subprocess.Popen, delay: float) -> None:
    """SIGTERM `delay` seconds after the process can catch it: anywhere in start-up or training."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and not _catches_sigterm(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)


# How each kind of run is stopped: a fault injected at a step (MESHLM_INJECT_FAULT, meshlm/faults.py), or
# SIGTERM sent from here. Every SIGTERM pattern must end with exit 0.
SIGTERMS = ("sigterm", "sigterm-twice", "sigterm-start", "sigterm-save", "launch-sigterm-all")
FAULTS = {"kill": "kill", "save-kill": "save-kill", "sigterm-save": "sigterm@save", "launch-sigterm-all": "sigterm-all"}


@pytest.mark.slow  # a run killed, stopped and restarted many times: ~2 minutes on 2 busy cores
def test_random_kills_terminations_and_corruption_end_as_an_uninterrupted_run(data_cache: str, tmp_path: Path) -> None:
    def args_for(run_dir: Path) -> list[str]:
        return [*small_run_args(data_cache, run_dir), "--train.steps", str(STEPS), "--checkpoint.every", str(EVERY),
                "--checkpoint.keep", "2", "--train.eval_every", "0", "--log.every", "1", "--log.peak_flops", "1e12",
                "--checkpoint.allow_fresh_start", "true"]  # fmt: skip

    reference_dir = tmp_path / "uninterrupted"
    with _one_thread():
        train(load_config(None, parse_overrides(args_for(reference_dir))))
    expected_weights = load_model_state(list_checkpoints(reference_dir)[-1])

    run_dir, rng = tmp_path / "soak", random.Random(SEED)
    args, metrics, checkpoints = args_for(run_dir), run_dir / "metrics.jsonl", run_dir / "checkpoints"
    others = ["kill", "save-kill", "corrupt", "sigterm-twice", "sigterm-start", "sigterm-save", "launch-sigterm-all"]
    plan = ["sigterm", *rng.sample(others, len(others))]  # the first leaves a checkpoint
    history = []
    for kind in plan:
        start = _newest_valid_step(run_dir)
        if (kind == "corrupt" or start == STEPS) and list_checkpoints(run_dir):
            _corrupt(list_checkpoints(run_dir)[-1], rng)
            start = _newest_valid_step(run_dir)
        kind = kind if kind != "corrupt" else rng.choice(["kill", "save-kill"])
        leftovers = sorted(p.name for p in checkpoints.glob(".tmp-step_*"))
        saves = [s for s in range(start + 1, STEPS + 1) if s % EVERY == 0 or s == STEPS]
        step = rng.choice(saves) if "save" in kind else rng.randint(start + 1, STEPS)
        delay = rng.uniform(0, 4) if kind == "sigterm-start" else None
        history.append((start, kind, step, delay))

        offset = len(metrics.read_text()) if metrics.exists() else 0
        fault = f"0:{step}:{FAULTS[kind]}" if kind in FAULTS else ""
        proc = _train_process(args, fault, launch=kind.startswith("launch"))
        if kind in ("sigterm", "sigterm-twice"):
            _sigterm_after_a_step(proc, metrics, offset, times=2 if kind == "sigterm-twice" else 1)
        if delay is not None:  # anywhere: imports, set-up, resume or training; each has its promised ending
            _sigterm_after(proc, delay)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == (0 if kind in SIGTERMS else -signal.SIGKILL), (history, out)
        assert "Traceback" not in out, (history, out)
        if kind in SIGTERMS:  # one save, or nothing to save before the first step; never two
            ends = out.count("SIGTERM: saved step") + out.count("preempted before the first step; nothing to save")
            assert ends <= 1, (history, out)  # none: the notice came after the last save, in teardown
        if kind.startswith("launch"):
            assert out.strip().splitlines()[-1] in (  # a notice after the last step finds a finished run
                "meshlm launch: SIGTERM: every worker stopped cleanly; exiting 0",
                "meshlm launch: SIGTERM after the run finished: nothing to save; exiting 0",
            ), (history, out)
        resumed = re.search(r"resuming from \S+ at step (\d+)", out)
        if resumed or "preempted before the first step" not in out:  # start-up may stop before the resume line
            assert (int(resumed[1]) if resumed else 0) == start, (history, out)
        if leftovers and "preempted before the first step" not in out:
            assert f"removed {', '.join(leftovers)}" in out, (history, out)

    start = _newest_valid_step(run_dir)
    with _one_thread():
        finished = train(load_config(None, parse_overrides(args)))
    assert (finished.start_step, finished.final_step) == (start, STEPS), history
    weights = load_model_state(list_checkpoints(run_dir)[-1])
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), (name, history)
