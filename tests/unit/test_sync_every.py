"""The hot path without host syncs: `train.sync_every = k` reads losses and norms once per k steps, guards
them late (a rejected update is rolled back, or the run stops), and batches come from a background thread
without moving the checkpointed data position."""

import json
import math
from pathlib import Path

import pytest
import torch
from test_guards import poison

from meshlm.checkpoint import list_checkpoints, load_model_state
from meshlm.config import ConfigError, load_config, parse_overrides
from meshlm.observe.step import StepObserver
from meshlm.observe.timers import Timers
from meshlm.train import trainer as trainer_module
from meshlm.train.guards import DeviceStepGuard, StepGuard, TrainingFault
from meshlm.train.parts import IterableBatches
from meshlm.train.prefetch import Prefetcher


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((4, 3), i), torch.full((4, 3), -i)) for i in range(n)]


def test_prefetcher_hands_out_the_source_stream_and_its_consumed_position() -> None:
    source = IterableBatches(_batches(5))
    pre = Prefetcher(source, limit=4)
    seen = []
    for step in range(1, 4):
        x, _ = pre.next_batch(1, 2)
        seen.append(int(x[0, 0]))
        assert x.shape == (2, 3) and pre.step == step and pre.state_dict() == {"step": step}
    assert seen == [0, 1, 2]
    pre.load_state_dict({"step": 1})  # a resume rewinds past the batch fetched ahead
    assert int(pre.next_batch(1, 2)[0][0, 0]) == 1 and pre.state_dict() == {"step": 2}
    assert int(pre.next_batch(0, 4)[0][0, 0]) == 2  # another split: the batch fetched ahead is refetched
    assert pre.next_batch(0, 4)[0].shape == (1, 3) and pre.step == 4
    pre.close()  # waits for any fetch in flight
    assert source.step == 4  # the limit: nothing fetched beyond the run's last step


def test_observer_window_reports_the_mean_step_and_syncs_once() -> None:
    clock = iter(range(0, 100, 2))  # every clock read advances 2 s
    observer = StepObserver(1e9, 100, peak_flops=1e12, timers=Timers(clock=lambda: float(next(clock))))
    try:
        observer.start_step()  # window opens: clock 0
        assert observer.end_step(close=False) is None
        observer.start_step()  # joins the window: no clock read
        metrics = observer.end_step()  # clock 2: two steps in 2 s
    finally:
        observer.close()
    assert metrics["step_time_s"] == 1.0 and metrics["tokens_per_s"] == 100.0


def test_sync_every_skip_policy_with_an_optimizer_that_cannot_skip_on_the_device_is_refused(
    small_run: list[str],
) -> None:
    cfg = load_config(None, parse_overrides([*small_run, "--train.sync_every", "4"]))

    def foreach_adamw(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, foreach=True)

    with pytest.raises(ConfigError, match=r"train.sync_every = 4 with fault.nonfinite = 'skip' needs an optimizer"):
        trainer_module.fit(cfg, optimizer=foreach_adamw)


def test_sync_every_auto_is_every_step_on_cpu_with_the_default_optimizer(small_run: list[str], monkeypatch) -> None:
    built = []
    monkeypatch.setattr(trainer_module.Trainer, "run", lambda self: built.append(self) or self.result)
    trainer_module.train(load_config(None, parse_overrides([*small_run, "--train.steps", "2"])))
    (trainer,) = built
    assert trainer.sync_every == 1 and trainer.device_guard is None
    assert "foreach" in repr(trainer.optimizer.defaults) and not trainer.optimizer.defaults["fused"]


def test_device_guard_decides_as_the_host_guard() -> None:
    """Skips on the device exactly where StepGuard skips: non-finite loss or norm, and spikes against the
    window of applied losses (which a skipped loss does not join)."""
    losses = [2.0, 2.1, 1.9, 2.0, 2.2, math.nan, 9.0, 2.1, 2.0, 6.5, 6.0, 2.0] + [2.0 - 0.05 * i for i in range(25)]
    norms = [1.0] * len(losses)
    norms[8] = math.inf
    host, device = StepGuard("skip", spike_factor=3.0), DeviceStepGuard(3.0, torch.device("cpu"))
    verdicts = [
        (host.allow(x, n), bool(device.allow(torch.tensor(x), torch.tensor(n))))
        for x, n in zip(losses, norms, strict=True)
    ]
    assert [h for h, _ in verdicts] == [d for _, d in verdicts]
    skipped = [i for i, (h, _) in enumerate(verdicts) if not h]
    assert skipped == [5, 6, 8, 9]  # nan, spike 9.0 > 3 × 2.04, inf norm, spike 6.5 > 3 × 2.05 (6.0 is not)
    unguarded = DeviceStepGuard(0.0, torch.device("cpu"))
    assert bool(unguarded.allow(torch.tensor(9.0), torch.tensor(1.0)))


def _fused_adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)


def test_skip_without_a_host_sync_trains_exactly_as_skipping_after_one(small_run: list[str], monkeypatch) -> None:
    """train.sync_every = 4 with fault.nonfinite = 'skip': the NaN step is vetoed on the device (the fused
    AdamW's found_inf) and the run is bitwise the synced one, which reads each step and skips on the host."""
    poison(monkeypatch, lambda n: (n - 1) % 8 + 1 in (3, 6))  # the same steps of each 8-step run

    def run(name: str, *extra: str) -> tuple[trainer_module.TrainResult, Path]:
        run_dir = Path(small_run[small_run.index("--log.run_dir") + 1]).parent / name
        overrides = [*small_run, "--train.steps", "8", "--train.eval_every", "0", "--checkpoint.every", "0",
                     "--log.every", "4", "--log.run_dir", str(run_dir), *extra]  # fmt: skip
        return trainer_module.fit(load_config(None, parse_overrides(overrides)), optimizer=_fused_adamw), run_dir

    synced, synced_dir = run("synced", "--train.sync_every", "1")
    late, late_dir = run("late", "--train.sync_every", "4")
    assert synced.skipped_steps == late.skipped_steps == [3, 6]
    assert late.losses == synced.losses and all(math.isfinite(x) for x in late.losses[6:])
    (a,), (b,) = list_checkpoints(synced_dir), list_checkpoints(late_dir)
    for name, tensor in load_model_state(a).items():
        assert torch.equal(tensor, load_model_state(b)[name]), name
    faults = [json.loads(line) for line in (late_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in faults if r["kind"] == "fault"] == [(3, "skipped"), (6, "skipped")]


def _run(small_run: list[str], name: str, *extra: str) -> tuple[trainer_module.TrainResult, Path]:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1]).parent / name
    overrides = [*small_run, "--train.steps", "10", "--train.eval_every", "5", "--checkpoint.every", "0",
                 "--log.every", "5", "--fault.nonfinite", "rollback", "--log.run_dir", str(run_dir),
                 *extra]  # fmt: skip
    return trainer_module.train(load_config(None, parse_overrides(overrides))), run_dir


def test_sync_every_trains_exactly_as_syncing_every_step(small_run: list[str]) -> None:
    every, every_dir = _run(small_run, "every")
    late, late_dir = _run(small_run, "late", "--train.sync_every", "4")
    assert late.losses == every.losses and len(late.losses) == 10  # bitwise: the same ops in the same order
    assert late.eval_losses == every.eval_losses
    (a,), (b,) = list_checkpoints(every_dir), list_checkpoints(late_dir)
    for name, tensor in load_model_state(a).items():
        assert torch.equal(tensor, load_model_state(b)[name]), name
    logged = [json.loads(line) for line in (late_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "train"] == [1, 5, 10]


def test_late_guard_rolls_back_the_applied_update(small_run: list[str], monkeypatch) -> None:
    poison(monkeypatch, lambda n: n == 3)  # read at step 4, after steps 3 and 4 were applied
    result, run_dir = _run(small_run, "late", "--train.steps", "6", "--train.sync_every", "4",
                           "--checkpoint.every", "2", "--checkpoint.keep", "10", "--train.eval_every", "0")  # fmt: skip
    assert result.skipped_steps == [3] and result.rollbacks == [3] and result.final_step == 6
    saved = {p.name: load_model_state(p) for p in list_checkpoints(run_dir)}
    for name, tensor in saved["step_00000002"].items():  # step 4's checkpoint holds step 2's weights
        assert torch.equal(tensor, saved["step_00000004"][name]), name
    assert all(torch.isfinite(t).all() for t in saved["step_00000006"].values())
    faults = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (fault,) = [r for r in faults if r["kind"] == "fault"]
    assert fault["step"] == 3 and fault["action"] == "rolled back to step_00000002"


def test_late_guard_without_a_checkpoint_stops(small_run: list[str], monkeypatch) -> None:
    poison(monkeypatch, lambda n: n == 2)
    with pytest.raises(TrainingFault, match=r"at step 2, applied before it was read \(train.sync_every = 4\)"):
        _run(small_run, "late", "--train.steps", "6", "--train.sync_every", "4", "--train.eval_every", "0",
             "--log.every", "100", "--log.aggregate_every", "0")  # fmt: skip
