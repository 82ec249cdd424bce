"""One rank of a check run, started by torchrun (`python -m torch.distributed.run ... -m meshlm.check.worker JOB`),
or alone at world 1 (`python -m meshlm.check.worker JOB`: a one-rank group of its own).

JOB is a pickle written by meshlm.check.run: the run's Config, the global batches, the user's pieces (model
factory, plan, loss) if any, and the mode ('train', 'resume': the same from the run directory's checkpoint,
or 'grads'). The run is `meshlm.fit` itself, with the batches as its data and a callback that records what the
trainer does not already write to metrics.jsonl: the full weights after the last step. Mode 'grads' steps
(its last step) with an optimizer that copies each gradient into its weight, so the full weights it gathers
(through the placement table, `ParallelModel.full_state_dict`) are the step's full gradients, under any
layout; it records each module's output of that step's first micro-batch too. Rank 0 writes the result
pickle named in the job; a rank that meets bad input (meshlm.errors.InputError) writes its one line beside
it (OUT.refused-RANK) and exits 2.
"""

from __future__ import annotations

import faulthandler
import fnmatch
import importlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from meshlm.errors import InputError
from meshlm.observe.metrics import load_metrics
from meshlm.parallel.dp.zero import resident
from meshlm.parallel.mesh import Layout
from meshlm.parallel.placement import REPLICAS, Placement
from meshlm.train.parts import Callback, IterableBatches
from meshlm.train.trainer import Trainer, fit


class CopyGradient(torch.optim.Optimizer):
    """weight := gradient (0 where a parameter got none): the weights after one step are the gradients. A step
    at learning rate 0 leaves the weights as they are, as any optimizer's does (the trainer creates optimizer
    state ahead of the first step with one: meshlm.checkpoint.state.init_optimizer_state)."""

    def __init__(self, groups: list[dict]) -> None:
        super().__init__([{"params": g["params"]} for g in groups], {"lr": 1.0})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            if group["lr"] == 0.0:
                continue
            for p in group["params"]:
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))


def placement_line(place: Placement, layout: Layout) -> str:
    """How this rank holds a parameter of placement `place` ('sharded tp dim 0 per-head; reduced over dp'): each
    mesh dimension that cuts it, tp if it holds it whole, tied stages, and the group that reduces its gradient."""
    parts = [f"sharded {s.mesh_dim} dim {s.dim}" + (" per-head" if len(s.pieces) > 1 else "") for s in place.shards]
    if place.on("tp") is None and layout.tp > 1:
        parts.append("replicated over tp")
    if place.pp_tied:
        parts.append("tied over the first and last pipeline stages")
    if layout.dp * layout.cp > 1:
        parts.append("reduced over dp" if place.grad_group == REPLICAS else f"reduced over {place.grad_group}")
    return "; ".join(parts) or "whole on one rank"


class Outputs:
    """The input and output of each module's first call in this process (its first micro-batch), in the order
    the calls end (a module's children before it), and the shape of the first token-id input (rows, sequence)."""

    def __init__(self) -> None:
        self.first: dict[nn.Module, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.tokens: tuple[int, ...] | None = None
        self.handle = register_module_forward_hook(self.hook)

    def hook(self, module: nn.Module, args: tuple, output: object) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.tokens is None and first is not None and not first.is_floating_point():
            self.tokens = tuple(first.shape)
        out = output[0] if isinstance(output, tuple) and output else output
        if isinstance(out, torch.Tensor) and out.is_floating_point() and module not in self.first:
            given = first.detach().clone() if first is not None and first.is_floating_point() else None
            self.first[module] = (given, out.detach().clone())

    def clear(self) -> None:
        self.first, self.tokens = {}, None

    def named(self, chunks: list[nn.Module], placements: object) -> dict[str, dict]:
        """Per module name: its input and output and, for a tp-sharded Linear, where this rank's columns of
        its output (weight split on dim 0) or of its input (dim 1) sit in the full tensor (Shard.pieces)."""
        names = {module: name for chunk in chunks for name, module in chunk.named_modules() if name}
        out = {}
        for module, (given, output) in self.first.items():
            if module not in names:
                continue
            weight = getattr(module, "weight", None)
            shard = placements[weight].on("tp") if isinstance(weight, torch.Tensor) else None
            linear = (  # a Linear's shapes: (.., in) -> (.., out) with a weight (out, in); not an embedding's
                shard is not None
                and given is not None
                and weight.ndim == 2
                and (given.shape[-1], output.shape[-1]) == (weight.shape[1], weight.shape[0])
            )
            out[names[module]] = {
                "in": given,
                "out": output,
                "in_shard": shard.pieces if linear and shard.dim == 1 else None,
                "out_shard": shard.pieces if linear and shard.dim == 0 else None,
            }
        return out


def describe(style: object) -> str:
    """A plan entry's style in one line ('rowwise', 'FusedColwise(blocks=2)')."""
    if isinstance(style, str) or not hasattr(style, "__dataclass_fields__"):
        return str(style)
    fields = ", ".join(
        f"{key}={value!r}" for key, value in vars(style).items() if not callable(value) and value not in (None, False)
    )
    return f"{type(style).__name__}({fields})"


def where_raised(error: BaseException, plan: object) -> str | None:
    """'layers.0.mlp.down (plan entry 'layers.*.mlp.down': colwise)': the innermost module whose forward the
    error was raised in (from the traceback's frames: a module's `self`), named from the outermost one (the
    model or its pipeline stage), with the plan entry that matches it; None outside any module's forward."""
    modules: list[nn.Module] = []
    tb = error.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, nn.Module) and (not modules or modules[-1] is not me):
            modules.append(me)
        tb = tb.tb_next
    if not modules:
        return None
    names = {id(module): name for name, module in modules[0].named_modules()}
    name = next((names[id(m)] for m in reversed(modules) if names.get(id(m))), None)
    if name is None:
        return None
    if plan is None:
        from meshlm.parallel.plan_registry import plan_for

        plan = plan_for(modules[0])
    return f"{name} ({entry_line(name, plan)})"


def entry_line(name: str, plan: object) -> str:
    """ "plan entry 'layers.*.mlp.down': colwise" for module `name`, or that the plan has none for it."""
    entry = next((key for key in plan.tensor_parallel if fnmatch.fnmatchcase(name, key)), None)
    if entry is None:
        return f"no plan entry in {plan.name!r}: whole on every tp rank"
    return f"plan entry {entry!r}: {describe(plan.tensor_parallel[entry])}"


class StepBatches(IterableBatches):
    """The batches, clearing `outputs` as each step takes its batch: what they hold is that step's (a forward
    run before the steps, a probe of the model, is not)."""

    def __init__(self, batches: list, outputs: Outputs | None) -> None:
        super().__init__(batches)
        self.outputs = outputs

    def next_batch(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.outputs is not None:
            self.outputs.clear()
        return super().next_batch(dp_rank, dp)


class Record(Callback):
    """After the last step: the full weights, each parameter's placement line and every rank's own copy of the
    parameters it holds whole (a copy that drifted from its replicas is invisible in the full weights, which
    take one of them); with `outputs`, each module's first output on every rank that holds the global batch's
    first rows (data-parallel rank 0)."""

    def __init__(self, steps: int, outputs: Outputs | None = None) -> None:
        self.steps, self.weights, self.placements, self.copies = steps, None, {}, []
        self.outputs, self.module_outputs, self.frozen, self.entries = outputs, [], set(), {}

    def on_step_end(self, trainer: Trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
        if step != self.steps:
            return
        model = trainer.model
        self.entries = {
            name: entry_line(name, model.plan) for chunk in model.chunks for name, _ in chunk.named_modules()
        }
        self.weights = model.full_state_dict()
        params = dict(model.named_parameters())  # this rank's
        mine = {name: placement_line(model.placements[p], trainer.layout) for name, p in params.items()}
        mine = {name: line for name, line in mine.items() if name in self.weights}
        whole = {
            name: p.detach().clone() for name, p in params.items() if not model.placements[p].shards and resident(p)
        }
        outputs = {}
        if self.outputs is not None and trainer.dp_rank == 0:
            outputs = {"tokens": self.outputs.tokens, "modules": self.outputs.named(model.chunks, model.placements)}
        every: list[tuple] = [() for _ in range(dist.get_world_size())]
        frozen = {name for name, p in params.items() if not p.requires_grad}
        dist.all_gather_object(every, (mine, whole, outputs, frozen))
        for found, copies, module_outputs, still in every:
            self.placements.update(found)
            self.frozen |= still
            self.copies.append(copies)
            if module_outputs:
                self.module_outputs.append(module_outputs)


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
    faulthandler.enable(all_threads=True)  # a rank killed by a fatal signal prints its Python stacks to the log
    torch.set_default_dtype(torch.float64)  # every check run in float64: meshlm.check.run's docstring says why
    job = pickle.loads(Path(job_path).read_bytes())
    cfg = job["config"]
    pieces = {key: resolve(value) for key, value in (job.get("parts") or {}).items()}
    outputs = None
    if job["mode"] == "grads":
        pieces["optimizer"], outputs = CopyGradient, Outputs()
    record = Record(cfg.train.steps, outputs)
    try:
        result = fit(cfg, data=StepBatches(job["batches"], outputs), callbacks=[record], **pieces)
    except InputError as e:  # the caller prints the lowest rank's line once (meshlm.check.run.run_job)
        Path(f"{job['out']}.refused-{os.environ.get('RANK', '0')}").write_text(str(e))
        sys.exit(2)
    except Exception as e:  # raised in a module's forward (a shape error): the module and its plan entry
        where = where_raised(e, pieces.get("plan"))
        if where is not None:
            line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            Path(f"{job['out']}.raised-{os.environ.get('RANK', '0')}").write_text(
                f"{where}\t{type(e).__name__}: {line}"
            )
        raise
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
        "outputs": record.module_outputs,
        "frozen": record.frozen,
        "entries": record.entries,
    }
    Path(job["out"]).write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
