"""Fault guards: non-finite / spiking steps are skipped or stop the run, desynced replicas are named,
a hung rank dumps its stack and exits non-zero, and SIGTERM checkpoints and exits 0."""

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from distributed import run_shared

from meshlm.checkpoint import list_checkpoints, load_model_state
from meshlm.cli import main as cli_main
from meshlm.config import load_config, parse_overrides
from meshlm.model import Transformer, preset
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.train import trainer as trainer_module
from meshlm.train.guards import StepGuard, TrainingFault, check_replicas_in_sync
from meshlm.train.parts import Callback
from meshlm.train.trainer import Trainer


def test_step_guard_skips_non_finite_and_spikes() -> None:
    guard = StepGuard("skip", spike_factor=3.0)
    assert all(guard.allow(2.0, 1.0) for _ in range(5))
    assert not guard.allow(math.nan, 1.0) and "non-finite" in guard.last_reason
    assert not guard.allow(2.0, math.inf) and guard.last_reason == "non-finite gradient norm inf (loss 2.0000)"
    assert not guard.allow(7.0, 1.0) and "loss spike" in guard.last_reason
    assert guard.allow(5.0, 1.0) and guard.last_reason == ""
    with pytest.raises(TrainingFault, match="non-finite"):
        StepGuard("stop", 0.0).allow(math.nan, 1.0)


def poison(monkeypatch: pytest.MonkeyPatch, poisoned: Callable[[int], bool]) -> None:
    """Give the n-th forward_backward of the run (1-based) a NaN gradient wherever poisoned(n)."""
    original = ParallelModel.forward_backward
    calls = []

    def forward_backward(self: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = original(self, inputs, targets)
        calls.append(1)
        if poisoned(len(calls)):
            next(self.chunks[0].parameters()).grad[0, 0] = float("nan")
        return loss

    monkeypatch.setattr(ParallelModel, "forward_backward", forward_backward)


def _faults(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "fault"]


class WeightsAfterStep(Callback):
    """Rank 0's full weights after every step."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, trainer: Trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
        self.weights[step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_injected_nan_gradient_skips_exactly_that_update(small_run: list[str], monkeypatch) -> None:
    """The vetoed step 3 leaves every weight as it was and names the non-finite part; its due save waits for
    the next applied update (step 4), so no checkpoint holds weights that just failed a step."""
    poison(monkeypatch, lambda n: n == 3)
    cfg = load_config(None, parse_overrides([*small_run, "--train.steps", "4", "--checkpoint.every", "1",
                                             "--checkpoint.keep", "4", "--train.eval_every", "0"]))  # fmt: skip
    seen = WeightsAfterStep()
    result = trainer_module.fit(cfg, callbacks=[seen])
    assert result.skipped_steps == [3]
    for name, before in seen.weights[2].items():  # the skipped step left every weight as it was
        assert torch.equal(before, seen.weights[3][name]), name
    saved = [p.name for p in list_checkpoints(Path(cfg.log.run_dir))]
    assert saved == ["step_00000001", "step_00000002", "step_00000004"], saved
    (fault,) = _faults(Path(cfg.log.run_dir))
    assert fault["step"] == 3 and fault["action"] == "skipped"
    assert fault["reason"].startswith("non-finite gradient norm nan (loss "), fault["reason"]  # the loss is finite


def test_a_run_of_vetoed_updates_stops_in_one_line_keeping_the_last_sound_checkpoint(
    small_run: list[str], monkeypatch, capsys
) -> None:
    """fault.max_skips consecutive vetoes stop a 'skip' run: `meshlm train` prints one line naming the field and
    the newest checkpoint, which holds the last applied update, and exits 1; no checkpoint of a vetoed step is
    committed."""
    poison(monkeypatch, lambda n: n >= 3)
    args = [*small_run, "--train.steps", "20", "--checkpoint.every", "1", "--checkpoint.keep", "10",
            "--train.eval_every", "0", "--fault.max_skips", "3"]  # fmt: skip
    assert cli_main(["train", *args]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("meshlm: stopping at step 5: 3 updates in a row vetoed (fault.max_skips = 3)"), line
    assert line.endswith("step_00000002"), line
    run_dir = Path(args[args.index("--log.run_dir") + 1])
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000001", "step_00000002"]


def test_rollback_restores_the_newest_checkpoint_and_keeps_the_data_position(small_run: list[str], monkeypatch) -> None:
    overrides = [*small_run, "--train.steps", "6", "--checkpoint.every", "1", "--checkpoint.keep", "10",
                 "--train.eval_every", "0", "--fault.nonfinite", "rollback"]  # fmt: skip
    poison(monkeypatch, lambda n: n == 4)
    cfg = load_config(None, parse_overrides(overrides))
    result = trainer_module.train(cfg)
    assert result.skipped_steps == [4] and result.rollbacks == [4] and result.final_step == 6
    run_dir = Path(cfg.log.run_dir)
    saved = {p.name: load_model_state(p) for p in list_checkpoints(run_dir)}
    for name, tensor in saved["step_00000003"].items():  # step 4's checkpoint holds step 3's weights
        assert torch.equal(tensor, saved["step_00000004"][name]), name
    state = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer.json").read_text())
    assert state["sampler"]["step"] == 4 and state["optimizer_steps"] == 3  # data moved on, updates did not
    (fault,) = _faults(run_dir)
    assert fault["step"] == 4 and fault["action"] == "rolled back to step_00000003"

    poison(monkeypatch, lambda n: n >= 4)  # a fault that a rollback does not cure stops the run
    again = [*overrides, "--log.run_dir", str(run_dir.parent / "again"), "--fault.max_rollbacks", "2"]
    with pytest.raises(TrainingFault, match=r"after 2 rollbacks \(fault.max_rollbacks = 2\)"):
        trainer_module.train(load_config(None, parse_overrides(again)))


def _desync_worker() -> str:
    torch.manual_seed(0)
    mesh = build_mesh(parse_layout("dp=2", 2), "cpu")
    model = parallelize(Transformer(preset("test")), mesh)
    check_replicas_in_sync(model)  # identical replicas pass
    if mesh.rank("dp") == 1:
        with torch.no_grad():
            model.chunks[0].model.layers["2"].mlp.up_proj.weight[0, 0] += 1e-3
    try:
        check_replicas_in_sync(model)
    except TrainingFault as e:
        return str(e)
    return "no error"


def test_desync_names_rank_and_tensor() -> None:
    messages = run_shared(_desync_worker, 2)
    for message in messages:
        assert "model.layers.2.mlp.up_proj.weight on dp rank 1 (global rank 1)" in message


def test_hung_rank_dumps_stack_and_exits_nonzero(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import time
        from meshlm.train.guards import Watchdog
        dog = Watchdog({str(tmp_path)!r}, rank=3, timeout_s=1.0)
        dog.arm()
        def stuck_in_collective():
            time.sleep(30)
        stuck_in_collective()
        print("the watchdog let the hang run its course")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "its course" not in out.stdout  # it fired within the 30 s hang, not after
    assert "stuck_in_collective" in (tmp_path / "stacks" / "rank3.txt").read_text()


def test_sigterm_checkpoints_exits_zero_and_resumes(small_run: list[str]) -> None:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    args = [*small_run, "--train.steps", "100000", "--checkpoint.every", "0", "--train.eval_every", "0",
            "--log.every", "1"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "train", *args], stdout=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert "SIGTERM: saved step" in proc.stdout.read()
    (saved,) = list_checkpoints(run_dir)
    step = int(saved.name.removeprefix("step_"))
    assert 0 < step < 100000
    resumed = trainer_module.train(load_config(None, parse_overrides([*args[:-2], "--train.steps", str(step + 2)])))
    assert resumed.start_step == step and resumed.final_step == step + 2
