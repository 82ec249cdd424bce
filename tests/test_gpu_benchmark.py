"""benchmarks/gpu/run.py is safe to run anywhere: without a CUDA device it says so and exits 0."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "run.py"


def test_gpu_benchmark_without_cuda_says_so_and_exits_zero() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no CUDA device")
