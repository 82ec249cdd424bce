"""benchmarks/gpu/run.py is safe to run anywhere (without a CUDA device it says so and exits 0), and every row's
code path runs on the CPU: each system is built and trained a few steps on a tiny model (gloo, world 1,
compiled rows with the aot_eager backend, the FP8 row through the emulated matmul), and the parent process runs
rows in subprocesses under their time limits and prints the table with the ratios."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "run.py"
TINY = ["--device", "cpu", "--model", "test", "--shape", '{"n_layers": 2, "vocab_size": 256}', "--batch", "2",
        "--seq-len", "32", "--warmup", "1", "--steps", "2", "--every", "2", "--backend", "aot_eager"]  # fmt: skip


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_without_cuda_says_so_and_exits_zero() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no CUDA device")


@pytest.mark.slow  # ~5-15 s per row on 2 cores (model build, compilation with aot_eager)
@pytest.mark.parametrize(
    "name", ["meshlm-eager", "meshlm-compiled", "fsdp2-eager", "fsdp2-compiled", "meshlm-fp8", "train-loop"]
)
def test_every_row_trains_on_cpu(name: str, tmp_path: Path) -> None:
    """Each row as the benchmark runs it: the script's own child process (a process group of its own, so no
    group the test session holds can collide with it), with no time limit but the test's."""
    out = tmp_path / "row.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--row", name, "--json", str(out), *TINY],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] >= 1 and result["tokens_per_s"] > 0
    if result["system"] != "train-loop":
        assert 0 < result["final_loss"] < 6.0  # log(256) = 5.5 at the start: a finite, sane loss


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_model_is_built_with_the_meshlm_init(tied: bool) -> None:
    """The FSDP2 row's model (meta build, allocated on the device, its own init) has the weights of a plain
    build, tied embeddings still tied (llama3-1b ties them): the fix for 'Expected a cuda device type for
    generator' must not change what is compared."""
    import torch

    from meshlm.model import Transformer

    bench = load_benchmark()
    cfg = bench.parse_args(TINY).cfg.replace(tie_embeddings=tied)
    built = bench.build_on(cfg, torch.device("cpu"))
    plain = Transformer(cfg, init_seed=0)
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied
    assert len(list(built.parameters())) == len(list(plain.parameters()))
    for (name, a), (_, b) in zip(built.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for name, b in plain.named_buffers():
        assert torch.equal(built.get_buffer(name), b), name


@pytest.mark.slow  # two rows in subprocesses: ~30-60 s on 2 cores
def test_parent_runs_rows_under_limits_and_prints_ratios() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--rows", "meshlm-eager,fsdp2-eager", "--budget-s", "600"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])},
    )
    assert out.returncode == 0, out.stderr
    assert "| meshlm-eager | 2×32 | eager |" in out.stdout and "| fsdp2-eager | 2×32 | eager |" in out.stdout
    assert "meshlm-eager / fsdp2-eager: tokens/s" in out.stdout


def test_a_row_past_its_limit_is_cut_and_a_row_past_the_budget_is_skipped() -> None:
    bench = load_benchmark()
    args = bench.parse_args([*TINY, "--budget-s", "10"])
    rows = {"slow": bench.Row("meshlm", False, 2, 32, limit_s=0.5), "late": bench.Row("meshlm", False, 2, 32, 60.0)}
    results = bench.run_all(args, rows)  # "late" needs min(60, 20) s and < 10 are left
    assert results == [
        {"name": "slow", "error": "timed out after 0 s"},
        {"name": "late", "error": "skipped: out of budget"},
    ]


@pytest.mark.slow  # ~60 s on 2 cores: four small trainings
def test_gpu_checks_pass_on_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu/checks.py with --device cpu: the emulated fp8, the guard (without the sync debug mode),
    ZeRO-3 at fp32 (auto on CPU), the CPU defaults and bf16 gradient accumulation (bf16 forced); each PASSes."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("checks.py")), "--device", "cpu", "--json", str(tmp_path / "c.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))] == [
        "PASS fp8-numerics", "PASS device-guard", "PASS bf16-gathers", "PASS cuda-defaults", "PASS grad-accum"
    ]  # fmt: skip


def test_check_script_is_valid_bash_and_runs_both_scripts() -> None:
    script = SCRIPT.with_name("check.sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "benchmarks/gpu/checks.py" in text and "benchmarks/gpu/run.py" in text
