"""The planner's calibrated step-time model: time-sharing of cores, fixed host time per micro-batch, the
pipeline on a shared node, tensor-parallel calls outside the layers, and the doctor figures behind them
(docs/planner.md, "Step time"). Exact numbers, no wall-clock assertions."""

from __future__ import annotations

import pytest

from meshlm.config import load_config
from meshlm.model.config import ModelConfig
from meshlm.observe.bandwidth import fit_link
from meshlm.observe.calibration import calibration, cpu_machine
from meshlm.parallel.mesh import Layout
from meshlm.plan import Candidate, Workload, collective_time, hardware, plan_for_config, step_time
from meshlm.plan.hardware import Link
from meshlm.plan.memory import Assumptions
from meshlm.plan.step_time import MEASURED_EFFICIENCY, micro_batch_time, time_share, work_time

TEST = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=128, max_seq_len=64)
FREE_LINK = {"alpha_s": 0.0, "beta_Bps": 1e30}  # collectives that cost nothing, to isolate compute


def cpu(cores: float = 2, layer_s: float = 0.0, micro_batch_s: float = 0.0, link: dict = FREE_LINK):
    """A calibrated cpu: 100 GFLOP/s with all `cores` busy."""
    ops = {op: link for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}
    cal = {
        "device": "cpu", "matmul_flops": 1e11, "memory_bw": 1e10, "cores": cores, "layer_overhead_s": layer_s,
        "micro_batch_overhead_s": micro_batch_s, "links": {"intra": ops},
    }  # fmt: skip
    return hardware(None, cal)


def test_ranks_time_share_the_cores():
    hw = cpu(cores=2)
    assert hw.per_rank(1).matmul_flops == hw.per_rank(2).matmul_flops == 5e10  # one core each
    assert hw.per_rank(4).matmul_flops == 2.5e10 and hw.per_rank(8).matmul_flops == 1.25e10
    assert hw.per_rank(8, busy=4).matmul_flops == 2.5e10  # only the busy ranks share
    assert hw.per_rank(4).memory_bytes == hw.memory_bytes / 4  # memory is split between all ranks
    assert [time_share(hw, n) for n in (1, 2, 3, 8)] == [1.0, 1.0, 1.5, 4.0]
    gpu = hardware("H100-SXM")
    assert gpu.per_rank(8) is gpu and time_share(gpu, 1024) == 1.0


def test_micro_batch_time_adds_host_time_on_cpu_and_overlaps_it_on_gpu():
    a = Assumptions()
    hw = cpu(cores=2, layer_s=1e-3, micro_batch_s=5e-4)
    work = work_time(4e9, 0.0, 0.0, hw, a, True, 2048, 128)
    assert work == pytest.approx(4e9 / (5e10 * MEASURED_EFFICIENCY))  # 0.1 s on one core
    assert micro_batch_time(work, 4, hw, busy=2) == pytest.approx(work + 4.5e-3)
    assert micro_batch_time(work, 4, hw, busy=4) == pytest.approx(2 * (work + 4.5e-3))  # 4 ranks, 2 cores
    gpu = hardware("H100-SXM")
    tiny = work_time(1e6, 0.0, 0.0, gpu, a, True, 2048, 128)  # ~2.5 ns of H100 compute: the host's launches bound it
    assert micro_batch_time(tiny, 4, gpu, busy=8) == 4 * gpu.layer_overhead_s + gpu.micro_batch_overhead_s
    big = work_time(1e15, 0.0, 0.0, gpu, a, True, 2048, 128)
    assert micro_batch_time(big, 4, gpu, busy=8) == pytest.approx(1e15 / (989e12 * gpu.gemm_efficiency))


def test_work_time_prices_attention_and_elementwise_bytes():
    """GEMMs at the device's GEMM rate; flash attention at its fraction of it (the kernel's published rate at
    the sequence length over MAMF: FlashAttention-2 at 16k, head 128, causal, 328 TFLOP/s on H100), on the
    FLOPs a causal flash kernel runs: half the square flops_per_token counts, its backward 2.5 forwards (3.5
    of the 3 counted), so 7/12 of them; unfused, the whole square at the GEMM rate; elementwise bytes at 80 %
    of HBM. Fails if the flash kernel is priced on the whole square."""
    gpu, a = hardware("H100-SXM"), Assumptions()
    gemm = 989e12 * gpu.gemm_efficiency
    flash = work_time(0.0, 1e15, 0.0, gpu, a, True, 16384, 128)
    assert flash == pytest.approx(1e15 * 7 / 12 / (gemm * 328 / 794.5))
    assert work_time(0.0, 1e15, 0.0, gpu, a, False, 16384, 128) == pytest.approx(1e15 / gemm)
    assert work_time(0.0, 0.0, 1e12, gpu, a, True, 16384, 128) == pytest.approx(1e12 / (3.35e12 * 0.8))


def test_overhead_favours_fewer_larger_micro_batches():
    w = Workload(TEST, 32, 8, 1e9, "fp32")
    times = {}
    for overhead in (0.0, 1e-3):
        hw = cpu(layer_s=overhead, micro_batch_s=overhead)
        times[overhead] = [step_time(w, Candidate(micro_batch=b), hw).total for b in (1, 2, 4, 8)]
    assert times[0.0] == pytest.approx([times[0.0][0]] * 4)  # compute alone is linear in tokens
    steps = [t - times[0.0][0] for t in times[1e-3]]
    assert steps == pytest.approx([8 * 5e-3, 4 * 5e-3, 2 * 5e-3, 5e-3])  # m × (4 layers + 1) ms


def test_auto_layout_takes_a_larger_micro_batch_on_cpu_when_calls_cost_time():
    cfg = load_config(overrides=[("train.global_batch", 8), ("data.seq_len", 128), ("train.device", "cpu")])
    ops = {op: FREE_LINK for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}
    cal = {"device": "cpu", "matmul_flops": 2e11, "memory_bw": 5e10, "cores": 2, "links": {"intra": ops}}
    free = plan_for_config(cfg, 1, {**cal, "layer_overhead_s": 0.0, "micro_batch_overhead_s": 0.0})
    assert free.micro_batch == 1  # a tie on time: the smallest memory wins
    paid = plan_for_config(cfg, 1, {**cal, "layer_overhead_s": 3.6e-4, "micro_batch_overhead_s": 2e-4})
    assert paid.micro_batch == 8


def test_oversubscribed_pipeline_is_bound_by_work_not_bubble():
    """pp=2,dp=2 on 4 ranks of the same machine rate: with 2 cores the idle stage's cores go to the other, so
    the step is the work (m slots at the all-busy speed); with 4 (slower) cores every rank owns one, and
    fill and drain add (p − 1) slots."""
    w = Workload(TEST, 32, 8, 1e9, "fp32")
    lay = Candidate(Layout(pp=2, dp=2), micro_batch=2)
    shared = step_time(w, lay, cpu(cores=2))
    assert shared.bubble == 0.0
    owned = step_time(w, lay, cpu(cores=4))
    m = 2
    assert owned.compute == pytest.approx(shared.compute)  # machine / 4 per rank either way
    assert owned.bubble == pytest.approx(owned.compute / m)  # (p − 1) = 1 slot
    pipeline = step_time(w, Candidate(Layout(pp=2), micro_batch=2), cpu(cores=2))  # 2 ranks, 2 cores
    assert pipeline.bubble == pytest.approx(pipeline.compute / 4)  # m = 4 slots, 1 in the bubble


def test_tensor_parallel_pays_for_embedding_head_and_loss_calls():
    """tp=2, one layer, alpha only: per micro-batch 4 layer all-reduces, the embedding's and the head's one
    each, and the loss's two."""
    alpha = 1e-3
    model = TEST.replace(n_layers=1)
    w = Workload(model, 32, 2, 1e9, "fp32")
    hw = cpu(cores=2, link={"alpha_s": alpha, "beta_Bps": 1e30})
    st = step_time(w, Candidate(Layout(tp=2), micro_batch=2), hw)
    call = collective_time("all_reduce", 1, 2, Link(alpha, 1e30))
    assert call == pytest.approx(2 * alpha)
    assert st.tp_comm == pytest.approx((4 + 2 + 2) * call)


def test_fit_recovers_alpha_and_beta_of_noisy_training_like_calls():
    """doctor's least squares over a sweep whose calls all pay a wake-up latency of 0.7 ms."""
    sizes = [4096 * 4**i for i in range(7)]
    beta = 2.5e9
    noise = [1.02, 0.97, 1.01, 0.99, 1.03, 0.98, 1.0]
    seconds = [(7e-4 + m / beta) * k for m, k in zip(sizes, noise, strict=True)]  # 2 ranks: one ring step
    alpha, fitted_beta = fit_link("all_reduce", 2, sizes, seconds)
    assert alpha == pytest.approx(7e-4 / 2, rel=0.05)  # 2(n−1) = 2 steps per all-reduce
    assert fitted_beta == pytest.approx(beta, rel=0.05)


def _rank(rank: int, shared: float, alone: float | None, layer_s: float, threads: int = 1) -> dict:
    return {
        "rank": rank, "host": "h", "device_name": "cpu", "memory_bytes": None, "framework_bytes": 4e8,
        "matmul_flops": shared, "matmul_shared_flops": shared, "matmul_alone_flops": alone, "matmul_threads": 1,
        "memory_bw": 1e10, "cores": 2, "threads": threads, "layer_overhead_s": layer_s,
        "micro_batch_overhead_s": layer_s / 2,
    }  # fmt: skip


def test_cpu_machine_from_ranks_sharing_two_cores():
    """8 ranks on 2 cores: each got a quarter of the machine, and their overheads took 4 times as long."""
    ranks = [_rank(r, 2.5e10, 5e10 if r == 0 else None, 1.6e-3) for r in range(8)]
    out = cpu_machine(ranks)
    assert out["matmul_flops"] == 2e11 and out["cores"] == 2.0
    assert out["memory_bw"] == 8e10  # 8 ranks' copies at once
    assert out["layer_overhead_s"] == pytest.approx(4e-4) and out["micro_batch_overhead_s"] == pytest.approx(2e-4)


def test_cpu_machine_counts_only_the_cores_it_gets():
    """2 ranks whose machine gave them 1.2 cores' worth (a busy or partly absent host), and a lone rank that
    filled both cores with 2 threads."""
    shared = cpu_machine([_rank(r, 3e10, 5e10 if r == 0 else None, 4e-4) for r in range(2)])
    assert shared["cores"] == pytest.approx(1.2) and shared["matmul_flops"] == 6e10
    assert shared["layer_overhead_s"] == pytest.approx(4e-4 / (2 / 1.2))
    alone = cpu_machine([_rank(0, 9e10, 5e10, 4e-4)])
    assert alone["cores"] == pytest.approx(1.8) and alone["layer_overhead_s"] == 4e-4
    capped = cpu_machine([_rank(0, 1.5e11, 5e10, 4e-4)])  # superlinear noise cannot exceed the affinity mask
    assert capped["cores"] == 2.0


def test_calibration_of_a_cpu_report_reaches_the_planner():
    report = {
        "device": "cpu", "world_size": 2, "ranks": [_rank(r, 5e10, 5e10 if r == 0 else None, 4e-4) for r in (0, 1)],
        "collectives": [],
    }  # fmt: skip
    cal = calibration(report)
    hw = hardware(None, cal)
    assert (hw.cores, hw.matmul_flops, hw.peak_flops) == (2.0, 1e11, 1e11)
    assert (hw.layer_overhead_s, hw.micro_batch_overhead_s) == (4e-4, 2e-4)
    assert hw.per_rank(2).matmul_flops == 5e10
