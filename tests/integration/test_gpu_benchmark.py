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


@pytest.mark.slow  # ~5-15 s per row on 2 cores (model build, compilation with aot_eager); torchrun rows ~30 s
@pytest.mark.parametrize(
    ("name", "world"),
    [("meshlm-eager", 2), ("meshlm-compiled", 2), ("fsdp2-eager", 2), ("fsdp2-compiled", 2), ("meshlm-fp8", 2),
     ("train-loop", 2), ("meshlm-compiled-b8-unfused", 2), ("zero1", 2), ("zero3", 2), ("cp", 2), ("ep", 2),
     ("hsdp", 4)],
)  # fmt: skip
def test_every_row_trains_on_cpu(name: str, world: int, tmp_path: Path) -> None:
    """Each row as the benchmark runs it: the script's own child process (a process group of its own, so no
    group the test session holds can collide with it; torchrun's gloo ranks for the rows of several GPUs),
    with no time limit but the test's; its peak memory (the CPU's RSS high-water mark) is reported."""
    out = tmp_path / "row.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--row", name, "--json", str(out), *TINY, "--world",
                           str(world)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] >= 1 and result["tokens_per_s"] > 0 and result["peak_gib"] > 0
    if result["system"] != "train-loop":
        assert 0 < result["final_loss"] < 6.0  # log(256) = 5.5 at the start: a finite, sane loss
    if result["gpus"] > 1:
        assert result["world"] == world


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
    assert "| meshlm-eager | world 1 | 2×32 | eager | fused |" in out.stdout
    assert "| fsdp2-eager | world 1 | 2×32 | eager | - |" in out.stdout
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
        "PASS fp8-numerics", "PASS device-guard", "PASS bf16-gathers", "PASS cuda-defaults", "PASS grad-accum",
        "PASS fused-loss",
    ]  # fmt: skip


def test_check_script_is_valid_bash_and_runs_both_scripts() -> None:
    script = SCRIPT.with_name("check.sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "benchmarks/gpu/checks.py" in text and "benchmarks/gpu/run.py" in text


def test_meshlm_rows_build_the_model_as_meshlm_train_does(monkeypatch) -> None:
    """The meshlm rows fuse the loss with the head as `meshlm train` does (train.fused_loss, on by default);
    the -unfused row turns it off. Mutation: run.py's meshlm_system without `loss=` (the model built as before,
    unfused) fails."""
    import torch
    import torch.distributed as dist

    from meshlm.parallel import engine

    bench = load_benchmark()
    args = bench.parse_args(TINY)
    rows = bench.rows_for(args.batch, args.seq_len)
    seen = []
    original = engine.parallelize
    monkeypatch.setattr(engine, "parallelize", lambda *a, **kw: seen.append(kw.get("loss")) or original(*a, **kw))
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for name in ("meshlm-eager", "meshlm-compiled-b8-unfused"):
        bench.meshlm_system(args.cfg, rows[name].__class__(**{**vars(rows[name]), "compiled": False}),
                            torch.device("cpu"), "aot_eager")  # fmt: skip
    assert [loss is not None and loss.fused for loss in seen] == [True, False]


def test_rows_of_several_gpus_are_skipped_with_a_line_on_one() -> None:
    bench = load_benchmark()
    args = bench.parse_args([*TINY, "--world", "1"])
    rows = {n: r for n, r in bench.rows_for(args.batch, args.seq_len, 1).items() if r.gpus > 1}
    assert sorted(rows) == ["cp", "ep", "hsdp", "zero1", "zero3"]
    results = bench.run_all(args, rows)
    assert {r["error"] for r in results} == {"skipped: needs 2 GPUs, 1 visible", "skipped: needs 4 GPUs, 1 visible"}
    assert "| zero1 | | | | | | skipped: needs 2 GPUs, 1 visible | | |" in bench.table(results, args)


def test_table_prints_the_fused_loss_ratio() -> None:
    bench = load_benchmark()
    args = bench.parse_args(TINY)
    rows = bench.rows_for(args.batch, args.seq_len)
    results = [
        {"name": name, **vars(rows[name]), "steps": 2, "tokens_per_s": tps, "final_loss": 5.0, "peak_gib": peak}
        for name, tps, peak in (("meshlm-compiled-b8", 125.0, 1.0), ("meshlm-compiled-b8-unfused", 100.0, 2.0))
    ]
    text = bench.table(results, args)
    assert (
        "fused loss / unfused (meshlm-compiled-b8 / meshlm-compiled-b8-unfused): tokens/s 1.250, peak memory 0.500"
        in text
    )
    assert "| meshlm-compiled-b8-unfused | world 1 | 4×32 | per block | unfused |" in text
