"""Step observability: the time breakdown, MFU, memory by category, and straggler detection across ranks."""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from torch import nn

from meshlm.observe import (
    TIMERS,
    ActivationMeter,
    StepObserver,
    Timers,
    aggregate,
    comm,
    mfu,
    summarize,
    tensor_bytes,
    timed_wait,
)
from meshlm.observe.profile import StepProfiler, parse_steps
from meshlm.observe.timers import bubble


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_breakdown_and_mfu_are_exact_with_a_known_clock() -> None:
    clock = FakeClock()
    timers = Timers(clock)
    observer = StepObserver(flops_per_step=6e9, tokens_per_step=1000, n_devices=2, peak_flops=1e10, timers=timers)
    observer.start_step()
    with observer.data_wait():
        clock.advance(0.5)
    clock.advance(1.0)  # compute
    with timers.span("comm/all_reduce"):
        clock.advance(0.25)
        with timers.span("bubble"):  # nested: ignored, the outer span already counts this time
            clock.advance(0.25)
    with timers.span("bubble"):
        clock.advance(0.5)
    with timers.span("comm/p2p"):
        clock.advance(0.5)
    m = observer.end_step()
    assert m["step_time_s"] == pytest.approx(3.0)
    assert m["data_wait_s"] == pytest.approx(0.5)
    assert m["comm_all_reduce_s"] == pytest.approx(0.5)
    assert m["comm_p2p_s"] == pytest.approx(0.5)
    assert m["comm_s"] == pytest.approx(1.0)
    assert m["bubble_s"] == pytest.approx(0.5)
    assert m["compute_s"] == pytest.approx(1.0)
    assert m["tokens_per_s"] == pytest.approx(1000 / 3)
    assert m["mfu"] == pytest.approx(6e9 / 3.0 / (2 * 1e10))  # 0.1
    assert m["mfu"] == pytest.approx(mfu(6e9, 3.0, 1e10, 2))

    observer.start_step()  # time between steps (evaluation) is dropped, not charged to the next step
    clock.advance(0.1)
    assert observer.end_step()["comm_s"] == 0.0
    observer.close()


def test_disabled_timers_are_shared_noops() -> None:
    assert not TIMERS.enabled
    assert comm("all_reduce") is comm("all_gather") is bubble()

    class Work:
        def wait(self) -> bool:
            return True

    assert timed_wait(Work(), "all_reduce") is True
    assert TIMERS.take() == {}
    start = time.perf_counter()
    for _ in range(100_000):
        with comm("all_reduce"):
            pass
    assert (time.perf_counter() - start) / 100_000 < 5e-6  # generous: a shared CI core


def test_parameter_gradient_and_adamw_bytes_are_exact() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    observer = StepObserver(1.0, 1, peak_flops=1.0, model=model, optimizer=optimizer)
    observer.start_step()
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()  # after the step: the probe measured at the high-water mark
    m = observer.end_step()
    observer.close()
    assert (m["mem_params_bytes"], m["mem_grads_bytes"], m["mem_optimizer_bytes"]) == (4 * psi, 4 * psi, 8 * psi)
    assert m["mem_rss_bytes"] > 0 and m["mem_rss_peak_bytes"] >= m["mem_rss_bytes"] // 2


def test_tensor_bytes_counts_each_storage_byte_once() -> None:
    flat = torch.zeros(100)
    views = [flat[:40], flat[30:60], flat[90:], flat[::10]]  # overlapping, and a strided view spanning 0..90
    assert tensor_bytes(views) == 4 * 100  # [0,60) ∪ [90,100) ∪ strided [0,91)
    assert tensor_bytes([flat[:10], flat[20:30]]) == 4 * 20
    assert tensor_bytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(0)]) == 6


def test_activation_meter_counts_saved_tensors_but_not_weights() -> None:
    layer = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    with ActivationMeter(layer) as meter:
        y = torch.tanh(layer(x))  # saves x (for the weight gradient), weightᵀ (a parameter) and tanh's output
        y.sum().backward()
    assert meter.peak == x.numel() * 4 + y.numel() * 4
    del y
    assert meter._current == 0  # every saved tensor was released with the graph


def test_summarize_min_median_max_and_straggler() -> None:
    per_rank = [
        {"step_time_s": 1.0, "compute_s": 0.5, "comm_all_reduce_s": 0.5},
        {"step_time_s": 1.1, "compute_s": 0.9},
        {"step_time_s": 1.0, "compute_s": 0.4, "comm_all_reduce_s": 0.6},
    ]
    s = summarize(per_rank, straggler_threshold=1.5)
    assert s["n_ranks"] == 3
    assert (s["compute_s_min"], s["compute_s_median"], s["compute_s_max"]) == (0.4, 0.5, 0.9)
    assert (s["comm_all_reduce_s_min"], s["comm_all_reduce_s_max"]) == (0.0, 0.6)  # absent timer: 0
    assert s["slowest_rank"] == 1 and s["straggler_ratio"] == pytest.approx(1.8) and s["straggler_rank"] == 1
    assert summarize(per_rank, straggler_threshold=2.0)["straggler_rank"] == -1
    assert summarize([{"step_time_s": 2.0}, {"step_time_s": 1.0}])["slowest_rank"] == 0  # no compute_s


# ---- a hand-made data-parallel loop on 4 gloo ranks ----------------------------------------------------------
DELAY_S, SLOW_S, STEPS = 0.3, 0.2, 3


def _loop(delay_rank: int | None, slow_rank: int | None) -> tuple[list[dict], list[dict], dict]:
    """Plain DDP by hand: the all-reduce is wrapped in comm(); one rank may sleep inside it (a slow link) or
    in its compute (a straggler). Also times each region independently, to check the observer against."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = StepObserver(1e9, 32 * 4, n_devices=dist.get_world_size(), peak_flops=1e9, model=model)
    metrics, own = [], []
    for _ in range(STEPS):
        observer.start_step()
        t0 = time.perf_counter()
        with observer.data_wait():
            x = torch.randn(32, 64)
            time.sleep(0.01)
        t1 = time.perf_counter()
        model(x).square().mean().backward()
        if rank == slow_rank:
            time.sleep(SLOW_S)
        t2 = time.perf_counter()
        with comm("all_reduce"):
            if rank == delay_rank:
                time.sleep(DELAY_S)
            for p in model.parameters():
                dist.all_reduce(p.grad)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t4 = time.perf_counter()
        metrics.append(observer.end_step())
        own.append({"data": t1 - t0, "compute": (t2 - t1) + (t4 - t3), "comm": t3 - t2, "step": t4 - t0})
    summary = aggregate(metrics[-1], straggler_threshold=1.2)
    observer.close()
    return metrics, own, summary


def _both_loops() -> dict:
    return {"delay": _loop(delay_rank=1, slow_rank=None), "slow": _loop(delay_rank=None, slow_rank=2)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_shared(_both_loops, 4)


def test_parts_sum_to_step_time_and_match_independent_timing(four_ranks: list[dict]) -> None:
    for result in four_ranks:
        for loop in ("delay", "slow"):
            for metrics, own in zip(*result[loop][:2], strict=True):
                parts = metrics["compute_s"] + metrics["comm_s"] + metrics["bubble_s"] + metrics["data_wait_s"]
                assert parts == pytest.approx(metrics["step_time_s"], rel=1e-9)
                # each part agrees with the loop's own clock to within a few percent of the step
                tolerance = 0.05 * own["step"] + 1e-3
                for name, key in (("step", "step_time_s"), ("comm", "comm_all_reduce_s"), ("data", "data_wait_s")):
                    assert metrics[key] == pytest.approx(own[name], abs=tolerance), name
                assert metrics["compute_s"] == pytest.approx(own["compute"], abs=tolerance)


def test_injected_communication_delay_is_exposed_comm(four_ranks: list[dict]) -> None:
    for rank, result in enumerate(four_ranks):
        steps = result["delay"][0]
        comm_s = statistics.median(m["comm_s"] for m in steps)
        compute_s = statistics.median(m["compute_s"] for m in steps)
        # the delayed rank sleeps inside the collective; the others wait for it inside theirs (medians over
        # steps: a loaded CI machine may deschedule a rank for a while)
        if rank == 1:
            assert min(m["comm_s"] for m in steps) >= DELAY_S
        assert comm_s >= 0.5 * DELAY_S
        assert compute_s < 0.5 * DELAY_S


def test_slowed_rank_is_named_straggler(four_ranks: list[dict]) -> None:
    last = [result["slow"][0][-1] for result in four_ranks]
    summary = four_ranks[0]["slow"][2]
    assert all(result["slow"][2] == summary for result in four_ranks)  # every rank gets the summary
    assert summary["straggler_rank"] == 2 and summary["slowest_rank"] == 2
    assert summary["straggler_ratio"] > 2
    compute = sorted(m["compute_s"] for m in last)
    assert (summary["compute_s_min"], summary["compute_s_max"]) == (compute[0], compute[-1])
    assert summary["compute_s_median"] == pytest.approx((compute[1] + compute[2]) / 2)
    assert summary["compute_s_max"] == last[2]["compute_s"] >= SLOW_S
    # the straggler's compute is the others' exposed communication; step times stay alike
    assert min(m["comm_s"] for i, m in enumerate(last) if i != 2) >= 0.8 * SLOW_S
    assert summary["step_time_s_max"] / summary["step_time_s_min"] < 1.2


def test_profiler_traces_exactly_the_chosen_steps(tmp_path) -> None:
    profiler = StepProfiler("2:3", tmp_path, rank=0, device=torch.device("cpu"))
    model = nn.Linear(16, 16)
    written = []
    for step in range(1, 5):
        profiler.before_step(step)
        model(torch.randn(4, 16)).sum().backward()
        written.append(profiler.after_step(step))
    assert written[:2] == [None, None] and written[3] is None
    assert written[2] == tmp_path / "trace_rank0_steps2-3.json"
    assert "traceEvents" in json.loads(written[2].read_text())
    assert list(tmp_path.iterdir()) == [written[2]]
    assert parse_steps("") is None and parse_steps("7") == (7, 7)
    with pytest.raises(ValueError, match="FIRST:LAST"):
        parse_steps("five")
    with pytest.raises(ValueError, match="FIRST <= LAST"):
        parse_steps("7:5")


def test_mfu_always_says_what_it_is_a_fraction_of(tmp_path) -> None:
    """On CPU the denominator is the matmul rate measured at start-up, not a nominal peak: the progress bar,
    the report and the planner all say so, in the same words."""
    import argparse

    from meshlm.observe.peak import DATASHEET_PEAK, MEASURED_MATMUL, mfu_basis
    from meshlm.observe.report import render
    from meshlm.plan.cli import ASSUMED_MATMUL, _mfu_basis
    from meshlm.plan.hardware import hardware

    measured = StepObserver(1e9, 128)
    given = StepObserver(1e9, 128, peak_flops=1e12)
    for observer in (measured, given):
        observer.close()
    assert measured.mfu_label(0.865) == "MFU 86.5% of measured matmul"
    assert given.mfu_label(0.25) == "MFU 25.0% of log.peak_flops"
    assert mfu_basis("cuda", "NVIDIA H100 80GB HBM3") == DATASHEET_PEAK
    assert mfu_basis("cuda", "NVIDIA L4") == mfu_basis("cpu") == MEASURED_MATMUL

    train = {"kind": "train", "time": 0.0, "loss": 5.0, "tokens_per_s": 1e3, "mfu": 0.865}
    lines = [{"step": 0, "kind": "env", "time": 0.0, "device": "cpu"}, {"step": 1, **train}, {"step": 2, **train}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = render(tmp_path)
    assert "median MFU (of measured matmul)" in page and "over the measured matmul of all devices" in page
    (tmp_path / "config.toml").write_text("[log]\npeak_flops = 1e12\n")
    assert "median MFU (of log.peak_flops)" in render(tmp_path)

    def plan_args(calibration: str | None) -> argparse.Namespace:
        return argparse.Namespace(calibration=calibration)

    assert _mfu_basis(hardware("H100-SXM"), plan_args(None)) == DATASHEET_PEAK
    assert _mfu_basis(hardware("cpu"), plan_args(None)) == ASSUMED_MATMUL
    assert _mfu_basis(hardware("cpu"), plan_args("doctor.json")) == MEASURED_MATMUL


def test_a_measured_peak_below_the_achieved_rate_is_raised_so_mfu_never_exceeds_100_percent() -> None:
    """The issue's 924.6 %: a CPU matmul rate measured while the CPU was busy. The observer raises such a
    measured peak to the achieved rate and says so; a given peak (log.peak_flops) is left alone. The first
    step (a warm-up sample) never raises it: no "MFU 100.0% ... raised" at step 1, and no figure above 100%."""
    clock = FakeClock()
    for given in (False, True):
        timers = Timers(clock)
        observer = StepObserver(6e9, 1000, peak_flops=1e8, timers=timers)
        if not given:
            observer.mfu_basis = "measured matmul"  # as on CPU: the rate measured at start-up, here 1e8
        for _ in range(2):
            observer.start_step()
            clock.advance(3.0)  # 2e9 FLOP/s achieved: 20× the peak
            m = observer.end_step()
            if observer.windows == 1 and not given:
                assert observer.peak_flops == 1e8 and not observer.peak_raised
                assert observer.mfu_label(m["mfu"]) == "MFU n/a (this first step ran above the measured matmul rate)"
        observer.close()
        if given:
            assert m["mfu"] == pytest.approx(20.0) and observer.mfu_label(m["mfu"]).endswith("of log.peak_flops")
        else:
            assert m["mfu"] == pytest.approx(1.0) and observer.peak_flops == pytest.approx(2e9)
            assert observer.mfu_label(m["mfu"]) == "MFU 100.0% of measured matmul, raised to the best achieved rate"


def test_progress_in_a_batch_job_is_plain_lines_and_fault_lines_always_print() -> None:
    """stdout not a terminal: a plain line every `every` steps with the whole ETA; `print` lines (faults)
    appear even with log.progress false; other ranks print nothing."""
    import io

    from meshlm.observe.metrics import TrainProgress

    out = io.StringIO()
    with TrainProgress(20, 0, enabled=True, rank0=True, every=10, stream=out) as bar:
        for step in range(1, 21):
            bar.update(step, 2.5, 1234.0, extra="MFU 10.0% of measured matmul")
        bar.print("step 20: update skipped: loss is nan")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["1/20", "10/20", "20/20"]
    assert lines[1].startswith("step 10/20 loss 2.5000 1,234 tok/s MFU 10.0% of measured matmul elapsed 0:00:0")
    assert " ETA 0:00:0" in lines[1] and lines[-1] == "step 20: update skipped: loss is nan"
    quiet = io.StringIO()
    with TrainProgress(20, 0, enabled=False, rank0=True, stream=quiet) as bar:
        bar.update(10, 2.5, 1.0)
        bar.print("step 10: update skipped: gradient norm is inf")
    assert quiet.getvalue() == "step 10: update skipped: gradient norm is inf\n"
    other = io.StringIO()
    with TrainProgress(20, 0, enabled=True, rank0=False, stream=other) as bar:
        bar.update(10, 2.5, 1.0)
        bar.print("step 10: update skipped")
    assert other.getvalue() == ""


def test_the_progress_bar_shows_no_numbers_before_step_1() -> None:
    """On a terminal: before step 1 the bar has no `loss 0.0000 0 tok/s` (nothing is measured yet)."""
    import io

    from rich.console import Console

    from meshlm.observe.metrics import TrainProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def shown(bar: TrainProgress) -> str:
        console = Console(file=io.StringIO(), width=160)
        console.print(bar._progress.get_renderable())
        return console.file.getvalue()

    bar = TrainProgress(20, 0, enabled=True, rank0=True, stream=Terminal())
    assert "step 0/20" in shown(bar) and "loss" not in shown(bar) and "tok/s" not in shown(bar)
    bar.update(1, 2.5, 1234.0, extra="MFU 10.0% of measured matmul")
    assert "step 1/20" in shown(bar) and "loss 2.5000  1,234 tok/s  MFU 10.0% of measured matmul" in shown(bar)


class FakeTracker:
    """Stands in for `wandb` or `mlflow` (never installed here): records what meshlm calls."""

    info = SimpleNamespace(run_id="mlflow-run-1")  # what mlflow's start_run returns carries the run's id

    def __init__(self, fails: str = "") -> None:
        self.calls: list[tuple] = []
        self.fails = fails

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            if name == self.fails:
                raise RuntimeError("the store refused the run\nand a second line")
            self.calls.append((name, args, kwargs))
            return self

        return call


def test_wandb_and_mlflow_get_the_scalars_beside_the_jsonl(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from meshlm.observe.metrics import MetricsLogger, TrackerError, read_metrics, tracker_ids, trackers

    assert trackers(tmp_path) == []  # off by default
    wandb, mlflow = FakeTracker(), FakeTracker()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    sinks = trackers(tmp_path / "run-7", "proj", "exp", {"train.lr": 0.003})
    logger = MetricsLogger(tmp_path / "run-7", tensorboard=False, sinks=sinks)
    logger.log(3, "train", loss=2.5, lr=0.001, layout="dp=2", ok=True)
    logger.close()
    assert wandb.calls[0][0] == "init" and wandb.calls[0][2]["project"] == "proj"
    run_id = wandb.calls[0][2]["id"]
    assert run_id.startswith("run-7-") and wandb.calls[0][2]["config"] == {"train.lr": 0.003}
    assert ("log", ({"train/loss": 2.5, "train/lr": 0.001},), {"step": 3}) in wandb.calls
    assert wandb.calls[-1][0] == "finish"
    names = [c[0] for c in mlflow.calls]
    assert names == ["set_experiment", "start_run", "log_params", "log_metrics", "end_run"]
    assert mlflow.calls[3] == ("log_metrics", ({"train.loss": 2.5, "train.lr": 0.001},), {"step": 3})
    assert json.loads((tmp_path / "run-7" / "metrics.jsonl").read_text())["layout"] == "dp=2"
    recorded = json.loads((tmp_path / "run-7" / "tracker_run.json").read_text())
    assert recorded == {"wandb": run_id, "mlflow": "mlflow-run-1"}

    # a resume continues both runs, and sends them only the steps past those they hold (3)
    wandb, mlflow = FakeTracker(), FakeTracker()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    sinks = trackers(tmp_path / "run-7", "proj", "exp", {"train.lr": 0.003})
    logger = MetricsLogger(tmp_path / "run-7", tensorboard=False, start_step=2, sinks=sinks)
    logger.log(3, "train", loss=2.5)
    logger.log(4, "train", loss=2.4)
    logger.close()
    assert wandb.calls[0][2]["id"] == run_id and mlflow.calls[1] == ("start_run", (), {"run_id": "mlflow-run-1"})
    assert [c[2]["step"] for c in wandb.calls if c[0] == "log"] == [4]
    assert [c[2]["step"] for c in mlflow.calls if c[0] == "log_metrics"] == [4]
    assert [(r["step"], r["kind"]) for r in read_metrics(tmp_path / "run-7")][1:] == [(2, "resume"), (3, "train"),
                                                                                        (4, "train")]  # fmt: skip
    assert not (tmp_path / "other").exists()  # another run directory, another W&B run
    monkeypatch.setitem(sys.modules, "wandb", FakeTracker())
    trackers(tmp_path / "other", "proj")
    assert tracker_ids(tmp_path / "other")["wandb"] != run_id

    for module, field in (("mlflow", "log.mlflow_experiment"), ("wandb", "log.wandb_project")):
        monkeypatch.setitem(sys.modules, module, FakeTracker(fails="start_run" if module == "mlflow" else "init"))
        with pytest.raises(TrackerError) as e:  # a tracker that cannot start: one line naming the field
            trackers(tmp_path / "failing", **{field.split(".")[1]: "proj"})
        assert str(e.value).startswith(f"{field}: ") and "(the store refused the run);" in str(e.value), e.value
        assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: one line naming the field and the extra
    with pytest.raises(TrackerError) as e:
        trackers(tmp_path, wandb_project="proj")
    assert str(e.value) == ("log.wandb_project needs the wandb package: pip install 'meshlm[wandb]' (or leave "
                            "log.wandb_project empty)")  # fmt: skip
