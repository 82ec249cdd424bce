#!/usr/bin/env bash
# The one script to run on a GPU machine (one H100/H200), from the repository root, with $OUT a folder for the
# results: the benchmark table (benchmarks/gpu/run.py, ≤ 5 minutes, each row under its own limit: meshlm as
# `meshlm train` builds it, fused loss and unfused at 8×2048, FSDP2, FP8, the train loop, peak memory per row;
# with more than one GPU visible also ZeRO-1/3, HSDP, CP and EP rows under torchrun, skipped with a line on one)
# and the GPU checks (benchmarks/gpu/checks.py: FP8 numerics, the device-side step guard, bf16 ZeRO gathers, the
# CUDA defaults, the fused loss's fp32 weight-gradient sum), under 8 minutes in all. Packages meshlm needs
# beyond torch (pydantic, ...) come as wheels in .whl/.
#
#     OUT=/tmp/out bash benchmarks/gpu/check.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    pip install -q --no-index --no-deps --target .gpu-site .whl/*.whl
fi
export PYTHONPATH=$PWD/.gpu-site:$PWD
began=$SECONDS
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/machine.txt"
# Checks first (about a minute): they are short and a wrong answer matters more than a missing figure.
timeout 150 python benchmarks/gpu/checks.py --json "$OUT/checks.json" 2>&1 | tee "$OUT/checks.txt"
echo "checks exit ${PIPESTATUS[0]} after $((SECONDS - began)) s" | tee -a "$OUT/checks.txt"
left=$((450 - (SECONDS - began)))  # of 480 s, 30 s kept for the tail
budget=$((left - 30 < 300 ? left - 30 : 300))
timeout "$left" python benchmarks/gpu/run.py --budget-s "$budget" 2>&1 | tee "$OUT/benchmark.md"
echo "benchmark exit ${PIPESTATUS[0]} after $((SECONDS - began)) s" | tee -a "$OUT/benchmark.md"
