"""meshlm as a library: your model, your loss, your loop, and every meshlm strategy under it.

    mesh = meshlm.init_mesh("dp=2,tp=2")                     # under torchrun, or one process
    model = meshlm.parallelize(MyModel(), mesh, {"zero": 1})  # the class's registered plan, or plan=...
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for x, y in batches:                                     # global batches, the same on every rank
        loss = my_loss(model(model.local_batch(x)), model.local_batch(y))
        model.backward(loss)                                 # overlapped, bucketed gradient reduction
        model.clip_grad_norm_(1.0)                           # the true global norm, any layout
        model.step(optimizer)                                # + ZeRO's gather of the new weights
    meshlm.shutdown()                                        # barrier + destroy_process_group

`parallelize` (meshlm.parallel.engine.parallelize, the one door into a ParallelModel, which meshlm's trainer goes
through too) returns a `ParallelModel`; under pipeline parallelism the loop calls
`model.forward_backward(x, y, loss_fn)` instead of forward + backward. `Checkpoints` saves and loads the
model, the optimizer and any JSON state (the data position) as sharded checkpoints that reshard to any
other layout. meshlm's own trainer is built on exactly these calls (meshlm.train.trainer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlm.checkpoint import (
    CheckpointIO,
    finish_saves,
    init_optimizer_state,
    load_step_counts,
    read_trainer_state,
    step_counts,
    training_entries,
)
from meshlm.parallel.distributed import end_process_group, init_distributed, resolve_device
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import Mesh, build_mesh, parse_layout

__all__ = ["Checkpoints", "init_mesh", "parallelize", "shutdown"]  # parallelize: meshlm.parallel.engine's

RESERVED = ("step", "optimizer_steps", "skipped_steps", "layout", "world_size")


def init_mesh(layout: str = "", device: str = "auto", timeout_s: float = 300.0) -> Mesh:
    """Join the process group (torchrun's environment, else a one-process group) and build the device mesh.

    `layout` names the size of each dimension, 'pp=2,dp=2,tp=2' (dp takes what the others leave); `device`
    is 'auto' (this rank's GPU if CUDA works), 'cpu' or 'cuda'; collectives give up after `timeout_s`."""
    dev = resolve_device(device)
    init_distributed(dev, timeout_s)
    return build_mesh(parse_layout(layout, dist.get_world_size()), dev.type)


def shutdown() -> None:
    """End a script's process group on success (collective): every background checkpoint save finished, then
    a barrier on every process group and `destroy_process_group` (meshlm.parallel.distributed.end_process_group
    says why each step: without them a rank could abort in teardown, "terminate called without an active
    exception", its work done: pytorch/pytorch#190489). Not after a failure: a barrier with a dead peer waits
    for the timeout."""
    if dist.is_initialized():
        finish_saves()
        end_process_group()


class Checkpoints:
    """Sharded, atomic, checksummed checkpoints of a ParallelModel and its optimizer under `run_dir`, plus any
    JSON-serialisable state (the data position, the step); any layout loads what any other saved.

    Every call is collective: all ranks call it together. `async_save` writes in the background while
    training goes on (`wait()` joins the save in flight)."""

    def __init__(self, run_dir: str | Path, keep: int = 3, async_save: bool = True, timeout_s: float = 300.0) -> None:
        self.run_dir = Path(run_dir)
        self.checkpointer = CheckpointIO(self.run_dir, keep, async_save, timeout_s)

    def save(self, step: int, model: ParallelModel, optimizer: torch.optim.Optimizer, **state: Any) -> float:
        """Save step `step`; returns the seconds training was held (the rest is written in the background)."""
        reserved = set(state) & set(RESERVED)
        if reserved:
            raise ValueError(f"Checkpoints.save: state keys {sorted(reserved)} are meshlm's own; rename them")
        init_optimizer_state(optimizer)
        meta = {
            **state,
            "step": step,
            **step_counts(model, optimizer),
            "layout": str(model.mesh.layout),
            "world_size": dist.get_world_size(),
        }
        return self.checkpointer.save(step, training_entries(model, optimizer, writer=True), meta)

    def load_latest(
        self, model: ParallelModel, optimizer: torch.optim.Optimizer, allow_fresh_start: bool = False
    ) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into `model` and `optimizer`, resharded to this layout; return the
        state saved with it (with 'step', 'layout', 'world_size'), or None when there is none yet.

        As at the start of `meshlm train`: folders of failed or interrupted saves are removed and corrupt
        checkpoints moved aside (each named in one line); when checkpoints exist but none is valid this raises
        CheckpointError rather than start over, unless `allow_fresh_start`."""
        self.wait()
        path = self.checkpointer.resume_point(True, allow_fresh_start)
        if path is None:
            return None
        saved = read_trainer_state(path)
        init_optimizer_state(optimizer)
        self.checkpointer.load(path, training_entries(model, optimizer))
        load_step_counts(model, optimizer, saved)
        model.after_load()
        return saved

    def poll(self, device: torch.device | str = "cpu") -> None:
        """Call once per step while saving asynchronously (collective): a save that failed on any rank raises
        its one-line StorageError on every rank here, at the next step, not at the next save."""
        self.checkpointer.poll(torch.device(device))

    def wait(self) -> None:
        """Block until the save in flight is committed on every rank (or raise why it failed)."""
        self.checkpointer.wait()
