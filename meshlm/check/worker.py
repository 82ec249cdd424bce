"""One rank of a check run, started by torchrun: `python -m torch.distributed.run ... -m meshlm.check.worker JOB`.

JOB is a pickle written by meshlm.check.run: the run's Config, the global batches, the user's pieces (model
factory, plan, loss) if any, and the mode ('train', 'resume': the same from the run directory's checkpoint,
or 'grads'). The run is `meshlm.fit` itself, with the batches as its data and
a callback that records what the trainer does not already write to metrics.jsonl: the full weights after the
last step. Mode 'grads' trains with AdamW up to its last step, at which it copies each gradient into its weight
(GradientsAt), so the full weights it gathers (through the placement table, `ParallelModel.full_state_dict`) are
that step's full gradients, under any layout; with more than one step it also records every module's outputs
in that last step's forward passes, on every rank. Rank 0 writes the result pickle named in the job. Bad input
(an InputError: a plan the layout refuses, a data problem) ends the rank with exit code 2 and its one line in
`OUT.error-RANK`, which meshlm.check.run reports as it is (never a traceback's line with its rank prefix).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import TrainSection
from meshlm.errors import InputError
from meshlm.observe.metrics import load_metrics
from meshlm.parallel.mesh import Layout
from meshlm.parallel.placement import Placement
from meshlm.train.parts import Callback, IterableBatches
from meshlm.train.trainer import Trainer, fit


class GradientsAt(torch.optim.AdamW):
    """meshlm's AdamW for the steps before the last, then weight := gradient (0 where a parameter got none) at
    the last: the weights after it are that step's gradients. A step at learning rate 0 is the trainer creating
    optimizer state ahead of the first step (meshlm.checkpoint.state.init_optimizer_state) and counts for none."""

    def __init__(self, groups: list[dict], train: TrainSection) -> None:
        super().__init__(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=True)
        self.last, self.done = train.steps, 0

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        if all(group["lr"] == 0.0 for group in self.param_groups):
            super().step()
            return
        self.done += 1
        if self.done < self.last:
            super().step()
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))


def placement_line(place: Placement, layout: Layout) -> str:
    """How this rank holds a parameter of placement `place` ('sharded tp dim 0 per-head; reduced over dp')."""
    parts = []
    if place.ep is not None:
        parts.append("experts sharded over ep")
    if place.tp is not None:
        parts.append(f"sharded tp dim {place.tp.dim}" + (" per-head" if len(place.tp.pieces) > 1 else ""))
    elif layout.tp > 1:
        parts.append("replicated over tp")
    if place.pp_tied:
        parts.append("tied over the first and last pipeline stages")
    if layout.dp * layout.cp > 1:
        parts.append("reduced over the expert's dp group" if place.expert else "reduced over dp")
    return "; ".join(parts) or "whole on one rank"


class Record(Callback):
    """After the last step: the full weights, each parameter's placement line and every rank's own copy of the
    parameters it holds whole (a copy that drifted from its replicas is invisible in the full weights, which
    take one of them)."""

    def __init__(self, steps: int, outputs: bool = False) -> None:
        self.steps, self.weights, self.placements, self.copies = steps, None, {}, []
        self.watch, self.mine, self.outputs = outputs, {}, []

    def keep(self, name: str, module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            self.mine.setdefault(name, []).append(output.detach().float().clone())

    def on_step_end(self, trainer: Trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
        if self.watch and step == self.steps - 1:  # the last step's forward passes: every module's outputs
            for chunk in trainer.model.chunks:  # this rank's pipeline chunks, under the model's module names
                for name, module in chunk.named_modules():
                    module.register_forward_hook(functools.partial(self.keep, name))
        if step != self.steps:
            return
        model = trainer.model
        self.weights = model.full_state_dict()
        params = dict(model.named_parameters())  # this rank's
        mine = {name: placement_line(model.placements[p], trainer.layout) for name, p in params.items()}
        mine = {name: line for name, line in mine.items() if name in self.weights}
        whole = {
            name: p.detach().float().clone()
            for name, p in params.items()
            if model.placements[p].tp is None and model.placements[p].ep is None and resident(p)
        }
        every: list[tuple] = [() for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, (mine, whole, self.mine))
        for found, copies, outputs in every:
            self.placements.update(found)
            self.copies.append(copies)
            self.outputs.append(outputs)


def resident(param: torch.Tensor) -> bool:
    """Whether this rank holds `param`'s values now: ZeRO-3 frees the gathered weights between uses (their
    storage is empty; the values live only in the shards, which full_state_dict gathers), and reading such a
    parameter reads freed memory."""
    return param.untyped_storage().nbytes() >= (param.storage_offset() + param.numel()) * param.element_size()


def resolve(value: object) -> object:
    """A piece meshlm.check.run.by_name sent as (module, name), imported; any other as it came."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "meshlm.check:by-name":
        return getattr(importlib.import_module(value[1]), value[2])
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "meshlm.check:by-path":  # the caller's script
        spec = importlib.util.spec_from_file_location("meshlm_check_script", value[1])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)  # its `if __name__ == "__main__":` part does not run
        return getattr(module, value[2])
    return value


def main(job_path: str) -> None:
    job = pickle.loads(Path(job_path).read_bytes())
    cfg = job["config"]
    grads = job["mode"] == "grads"
    record = Record(cfg.train.steps, outputs=grads and cfg.train.steps > 1)
    pieces = {key: resolve(value) for key, value in (job.get("parts") or {}).items()}
    if grads:
        pieces["optimizer"] = functools.partial(GradientsAt, train=cfg.train)
    try:
        result = fit(cfg, data=IterableBatches(job["batches"]), callbacks=[record], **pieces)
    except InputError as e:
        Path(f"{job['out']}.error-{os.environ.get('RANK', '0')}").write_text(str(e))
        sys.exit(2)
    if os.environ.get("RANK", "0") != "0" or not job.get("out"):  # fit has left the process group
        return
    records, _ = load_metrics(Path(cfg.log.run_dir))
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    steps = range(result.start_step + 1, result.final_step + 1)
    out = {
        "steps": list(steps),
        "losses": [train[s]["loss"] for s in steps],
        "grad_norms": [train[s]["grad_norm"] for s in steps],
        "weights": record.weights,
        "placements": record.placements,
        "copies": record.copies,
        "outputs": record.outputs,
    }
    Path(job["out"]).write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
