"""`meshlm doctor`: bandwidth definitions, the α–β fit, the planner's calibration, and a real torchrun run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import free_port

from meshlm.cli import add_doctor_parser, parse_bytes
from meshlm.observe.bandwidth import bus_factor, busbw, fit_link, ring_steps
from meshlm.observe.calibration import calibration
from meshlm.observe.doctor import default_sizes, run_doctor
from meshlm.plan.hardware import Calibration, Link, hardware
from meshlm.plan.network import collective_time

REPO = Path(__file__).resolve().parents[2]


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("send_recv", 2) == 1.0
    assert busbw("all_reduce", 8, 1e9, 1.0) == pytest.approx(1e9 * 2 * 7 / 8)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 4)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "send_recv"])
def test_fit_recovers_the_planners_alpha_and_beta(op: str) -> None:
    """Times from the planner's own α–β model come back as the same α and β."""
    n, alpha, beta = 4, 20e-6, 5e9
    n_ranks = 2 if op == "send_recv" else n
    sizes = [4096 * 4**i for i in range(7)]
    seconds = [collective_time(op, m, n_ranks, Link(alpha, beta)) for m in sizes]
    assert seconds[0] == pytest.approx(ring_steps(op, n_ranks) * alpha + bus_factor(op, n_ranks) * sizes[0] / beta)
    fit_alpha, fit_beta = fit_link(op, n_ranks, sizes, seconds)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert fit_beta == pytest.approx(beta, rel=1e-6)


def test_fit_stays_physical_on_noisy_sweeps() -> None:
    alpha, beta = fit_link("all_reduce", 4, [1e3, 1e6], [0.0, 1e-3])  # a negative intercept
    assert alpha == 0.0 and beta == pytest.approx(1.5 * 1e6 / 1e-3, rel=0.01)
    alpha, beta = fit_link("all_reduce", 4, [1e3, 1e6], [2e-3, 1e-3])  # latency-bound: falling times
    assert alpha > 0 and beta == pytest.approx(busbw("all_reduce", 4, 1e6, 1e-3))


def test_sizes_and_size_arguments() -> None:
    assert default_sizes("cpu") == [4096 * 4**i for i in range(7)]  # 4 KiB … 16 MiB
    assert default_sizes("cuda")[-1] == 2**30
    assert default_sizes("cpu", 1024, 16384) == [1024, 4096, 16384]
    assert [parse_bytes(s) for s in ("4K", "16M", "1G", "512", "64KiB")] == [4096, 2**24, 2**30, 512, 65536]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def _row(dim: str, op: str, group: list[int], alpha: float, beta: float, slow: bool = False) -> dict:
    return {"dim": dim, "op": op, "group": group, "alpha_s": alpha, "beta_Bps": beta, "slow": slow}


def test_calibration_of_a_two_node_gpu_report() -> None:
    """tp groups inside a node become `intra`, dp groups across nodes `inter`; slow groups do not enter fits."""
    ranks = [
        {"rank": r, "host": f"node{r // 2}", "device_name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30,
         "matmul_flops": 7e14 + r, "memory_bw": 3e12, "framework_bytes": 2e9}
        for r in range(4)
    ]  # fmt: skip
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        rows += [_row("tp", op, [0, 1], 3e-6, 3e11), _row("tp", op, [2, 3], 5e-6, 1e11, slow=True)]
        rows += [_row("dp", op, [0, 2], 8e-6, 4e10), _row("dp", op, [1, 3], 8e-6, 4e10)]
    report = {"device": "cuda", "world_size": 4, "ranks": ranks, "collectives": rows}
    cal = calibration(report)
    assert cal["device"] == "H100-SXM" and cal["gpus_per_node"] == 2
    assert cal["matmul_flops"] == pytest.approx(7e14 + 1.5)
    assert cal["dims"]["tp"]["all_reduce"] == {"alpha_s": 3e-6, "beta_Bps": 3e11}
    assert cal["links"]["intra"] == cal["dims"]["tp"] and cal["links"]["inter"] == cal["dims"]["dp"]
    hw = hardware(None, cal)  # the planner accepts it
    assert hw.name == "H100-SXM" and hw.link("tp", False, "all_gather").beta == 3e11


LAUNCHER = """
import sys
from meshlm.cli import main
sys.exit(main(["doctor", *sys.argv[1:]]))
"""


@pytest.mark.slow  # four torchrun ranks measuring links: ~10 s
def test_doctor_on_four_ranks_flags_the_slowed_rank(tmp_path: Path) -> None:
    launcher = tmp_path / "launch_doctor.py"
    launcher.write_text(textwrap.dedent(LAUNCHER))
    out = tmp_path / "doctor.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
        str(launcher), "--device", "cpu", "--out", str(out), "--max-bytes", "256K", "--iters", "5",
        "--budget-s", "0.05", "--slow-rank", "2", "--slow-factor", "5",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("Links (gloo, layout pp=1,dp=4,tp=1)", "all_reduce", "send_recv", "Ranks", "SLOW"):
        assert text in proc.stdout, proc.stdout
    assert "outlier: rank 2 " in proc.stdout

    cal = json.loads(out.read_text())
    Calibration.model_validate(cal)
    assert cal["device"] == "cpu" and cal["matmul_flops"] > 0 and cal["memory_bw"] > 0
    assert set(cal["dims"]["dp"]) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert cal["links"] == {"intra": cal["dims"]["dp"]}
    notes = cal["notes"]
    assert 2 in [r["rank"] for r in notes["ranks"] if r["slow"]]
    assert min(notes["ranks"], key=lambda r: r["matmul_flops"])["rank"] == 2
    pairs = sorted(r["group"] for r in notes["collectives"] if r["op"] == "send_recv")
    assert pairs == [[0, 1], [1, 2], [2, 3], [3, 0]]


def test_doctor_in_one_process_measures_only_the_rank(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers())
    args = parser.parse_args(["doctor", "--device", "cpu", "--out", str(tmp_path / "d.json")])
    assert run_doctor(args) == 0
    cal = json.loads((tmp_path / "d.json").read_text())
    assert cal["dims"] == {} and cal["links"] == {} and cal["notes"]["world_size"] == 1
    assert "Ranks" in capsys.readouterr().out
