"""Pipeline parallelism: split the layers into contiguous stages and run a schedule of micro-batches over them.

`split_model` keeps only this rank's stages ("chunks") of a plain model, as its plan's `PipelineSplit` says:
the first-stage modules (embedding) live on the first stage, the last-stage ones (final norm, head) on the
last, and with v virtual stages rank r holds stages r, r+p, ...
A weight the first and the last stage share (a tied embedding and head) is kept on both, as Megatron does:
`TiedStages` sums its two gradients over the embedding group (the first and last pp rank of each pipeline)
after every backward, so both copies take the same step and stay equal; checkpoints save it once.
`PipelineSchedule` executes the per-rank action list from `schedules.py` with point-to-point sends and
receives on the `pp` group; every wait has a timeout, so a dead or stuck neighbour ends the step with a
`PipelineError` that names the stage and micro-batch instead of hanging.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.llama import cross_entropy_loss
from meshlm.parallel.contract import LossFn
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.meta import MetaFailure, meta_forward, meta_hidden, meta_tokens
from meshlm.parallel.parallel_plan import ParallelPlan, PipelineSplit, PlanError
from meshlm.parallel.placement import Placements
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.pp.rules import check_pipeline_split
from meshlm.parallel.pp.schedules import COMPUTE, SENDS, WAITS, Action, build_schedule
from meshlm.parallel.pp.stages import split_layers
from meshlm.parallel.timers import bubble, comm

Key = tuple[str, int, int]  # a message: (direction F/B, chunk, micro-batch)


class PipelineError(RuntimeError):
    """A pipeline step that cannot finish: a neighbour failed, or a message did not arrive in time."""


# ---- splitting --------------------------------------------------------------------------------------
def linear_flops(module: nn.Module | None) -> float:
    """Forward FLOPs per token of a module's matmuls (2 per Linear weight); lookups (embeddings) are free."""
    if module is None:
        return 0.0
    return 2.0 * sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def module_stage_costs(model: nn.Module, split: PipelineSplit) -> tuple[float, float, float]:
    """(first-stage modules, one block, last-stage modules) by matmul FLOPs: the cost model for any plan
    without its own `stage_costs` (blocks are assumed alike)."""
    blocks = list(model.get_submodule(split.layers).children())

    def parts(names: tuple[str, ...]) -> float:
        return sum(linear_flops(model.get_submodule(n)) for n in names)

    return parts(split.first), linear_flops(blocks[0]), parts(split.last)


_MODULE_STATE = frozenset(vars(nn.Module()))  # what nn.Module keeps per instance: its tables, hooks, `training`


class _ReadThrough:
    """A stage view's class (a subclass of the model's own): what the view does not hold itself — anything but
    nn.Module's own tables and flags, and what is set on the view — is read from the user's module. A flag the
    user's loop sets on its model between steps (`model.use_adapter = step % 2`) thus reaches every stage, as it
    does a child module, which the views share."""

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)  # nn.Module's: the view's parameters, buffers and children
        except AttributeError:
            source = self.__dict__.get("_stage_source")
            if source is None:
                raise
            return getattr(source, name)


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type) -> type:
    if cls not in _VIEW_CLASSES:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _VIEW_CLASSES[cls] = type(cls.__name__, (_ReadThrough, cls), names)
    return _VIEW_CLASSES[cls]


def _private_copy(module: nn.Module) -> nn.Module:
    """A view of `module` sharing its parameters, buffers and children, with its own child, parameter and hook
    tables, so that changing the view (dropping a part, a ZeRO-3 hook) leaves the original alone; every other
    attribute is read from the original when it is read (_ReadThrough), not copied."""
    clone = object.__new__(_view_class(type(module)))
    for key, value in vars(module).items():
        if key not in _MODULE_STATE:
            continue
        if isinstance(value, dict) and (key in ("_modules", "_parameters", "_buffers") or "hook" in key):
            value = value.__class__(value)
        clone.__dict__[key] = value
    clone.__dict__["_stage_source"] = module
    return clone


def _stage_view(model: nn.Module, split: PipelineSplit, layer_keys: list[str], first: bool, last: bool) -> nn.Module:
    """The model as one stage sees it: its blocks only, and None for the first/last parts it does not own."""
    copies: dict[str, nn.Module] = {}

    def copy_of(path: str) -> nn.Module:
        if path not in copies:
            clone = _private_copy(model.get_submodule(path))
            if path:
                parent, _, attr = path.rpartition(".")
                copy_of(parent)._modules[attr] = clone
            copies[path] = clone
        return copies[path]

    root = copy_of("")
    layers = copy_of(split.layers)
    layers._modules = {k: layers._modules[k] for k in layer_keys}
    dropped = ([] if first else list(split.first)) + ([] if last else list(split.last))
    for path in dropped:
        parent, _, attr = path.rpartition(".")
        copy_of(parent)._modules[attr] = None
    return root


def split_model(
    model: nn.Module,
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    cost: str = "flops",
    plan: ParallelPlan | None = None,
    placements: Placements | None = None,
) -> list[nn.Module]:
    """This rank's chunks, in chunk order: chunk c is model stage c·pp_size + pp_rank (Megatron's assignment).
    A weight the first and the last stage both hold is recorded `pp_tied` in `placements`.

    Each chunk is a view of `model` sharing its modules, holding only its stage's blocks and None for the
    first/last parts it does not own (so parameter names stay the model's). Drop `model` to free the rest.
    """
    plan = plan or plan_for(model)
    n_stages = pp_size * virtual_stages
    check_pipeline_split(model, plan, n_stages)
    split = plan.pipeline
    keys = list(model.get_submodule(split.layers)._modules)
    ranges = _stage_ranges(model, plan, n_stages, boundaries, cost)
    if n_stages > 1 and placements is not None:
        for p in stage_ties(model, split):
            placements.record(p, pp_tied=True)  # read by the engine, data parallel and checkpoints
    return [
        _stage_view(model, split, [keys[i] for i in ranges[stage]], stage == 0, stage == n_stages - 1)
        for stage in range(pp_rank, n_stages, pp_size)
    ]


def _stage_ranges(
    model: nn.Module, plan: ParallelPlan, n_stages: int, boundaries: Sequence[int] | None = None, cost: str = "flops"
) -> list[range]:
    split = plan.pipeline
    if cost == "params":
        costs = _param_costs(model, split)
    elif plan.stage_costs is not None:
        costs = plan.stage_costs(model)
    else:
        costs = module_stage_costs(model, split)
    return split_layers(len(model.get_submodule(split.layers)._modules), n_stages, costs, boundaries)


def check_stage_forwards(model: nn.Module, plan: ParallelPlan, n_stages: int) -> None:
    """Every stage's forward runs without the parts it does not hold: each stage view (as split_model cuts
    it) runs once on a meta batch (meshlm.parallel.meta), token ids into the first, activations into the
    others. A forward that calls a part the stage sees as None is refused in one line, before any work."""
    split = plan.pipeline
    keys = list(model.get_submodule(split.layers)._modules)
    width = hidden_size(model, split)
    for stage, layers in enumerate(_stage_ranges(model, plan, n_stages)):
        first, last = stage == 0, stage == n_stages - 1
        view = _stage_view(model, split, [keys[i] for i in layers], first, last)
        x = meta_tokens() if first else meta_hidden(model, width)
        out = meta_forward(view, x)
        if isinstance(out, MetaFailure) and out.missing_part:
            missing = ([] if first else [f"first={list(split.first)}"]) + ([] if last else [f"last={list(split.last)}"])
            cls = type(model).__name__
            raise PlanError(
                f"plan {plan.name!r}: pipeline stage {stage} of {n_stages} ({split.layers} {layers.start}.."
                f"{layers.stop - 1}, without PipelineSplit {' and '.join(missing)}) cannot run {cls}'s forward: "
                f"{out.error}; valid: a forward that skips the parts a stage holds as None and takes the previous "
                f"stage's activations for token ids (as meshlm's Transformer), or {cls} without pp"
            )


def stage_ties(model: nn.Module, split: PipelineSplit) -> list[nn.Parameter]:
    """Parameters that a first-stage and a last-stage module both hold (a tied embedding and head), read
    off the module graph: the same Parameter object in both places."""
    first = {id(p) for name in split.first for p in model.get_submodule(name).parameters()}
    ties = {id(p): p for name in split.last for p in model.get_submodule(name).parameters() if id(p) in first}
    return list(ties.values())


def embedding_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """This rank's embedding group: the first and the last pp rank of its pipeline (None on a middle stage).
    Collective over the world: every rank creates every pipeline's group, in the same order."""
    pp = mesh.size("pp")
    if pp == 2:
        return mesh.group("pp")
    mine = None
    for line in mesh.device_mesh.mesh.reshape(pp, -1).T.tolist():  # pp is the mesh's outermost dimension
        ends = [line[0], line[-1]]
        group = dist.new_group(ends)
        if dist.get_rank() in ends:
            mine = group
    return mine


class TiedStages:
    """The weights this rank's first or last stage shares with the other end of its pipeline (Megatron's
    tied word embedding). Both ends hold a copy, equal at the start (drawn or loaded under one name); after
    each backward (and after data parallel's reduction, which both ends lay out alike: each tied weight is
    a flat buffer of its own) `all_reduce_grads` sums the two copies' gradients, the gradient the
    one-process model gets, so both take the same optimizer step. The last stage's copy is the `replica`:
    the gradient norm and checkpoints count the first stage's only."""

    def __init__(
        self, chunks: list[nn.Module], group: dist.ProcessGroup, replica: bool, placements: Placements
    ) -> None:
        self.chunks = chunks
        self.placements = placements
        self.group = group
        self.replica = replica

    @property
    def params(self) -> list[nn.Parameter]:
        """This end's trainable tied weights, read off its chunks when asked: a meta-built model's parameters
        are replaced by real ones after the stages are cut."""
        return tied_params(self.chunks, self.placements)

    @classmethod
    def build(
        cls, model: nn.Module, chunks: list[nn.Module], split: PipelineSplit, mesh: Mesh, placements: Placements
    ) -> TiedStages | None:
        """None without ties or on a middle stage; collective over the world when the model has ties."""
        if not stage_ties(model, split):
            return None
        group = embedding_group(mesh)
        if group is None or not tied_params(chunks, placements):
            return None
        return cls(chunks, group, mesh.rank("pp") == mesh.size("pp") - 1, placements)

    @torch.no_grad()
    def all_reduce_grads(self, grads: list[torch.Tensor]) -> None:
        """Sum each tied weight's gradient (or its data-parallel shard) with the other end's, in place."""
        with comm("all_reduce"):
            for grad in grads:
                dist.all_reduce(grad, group=self.group)


def tied_params(chunks: list[nn.Module], placements: Placements) -> list[nn.Parameter]:
    held = (p for chunk in chunks for p in chunk.parameters() if placements[p].pp_tied and p.requires_grad)
    return list({id(p): p for p in held}.values())


def _param_costs(model: nn.Module, split: PipelineSplit) -> tuple[float, float, float]:
    """(first, one block, last) by parameter count: balances memory rather than time."""

    def count(names: tuple[str, ...]) -> float:
        return float(sum(p.numel() for n in names for p in model.get_submodule(n).parameters()))

    block = next(iter(model.get_submodule(split.layers).children()))
    return count(split.first), float(sum(p.numel() for p in block.parameters())), count(split.last)


def hidden_size(model: nn.Module, split: PipelineSplit) -> int:
    """Width of the activations between stages: the split's own, else the first-stage embedding's."""
    if split.hidden_size:
        return split.hidden_size
    for name in split.first:
        for m in model.get_submodule(name).modules():
            if isinstance(getattr(m, "embedding_dim", None), int):  # nn.Embedding, or tp's vocab-parallel one
                return m.embedding_dim
    raise PlanError(
        f"pipeline split of {type(model).__name__}: set PipelineSplit.hidden_size (no first-stage embedding)"
    )


# ---- executing a schedule ---------------------------------------------------------------------------
@dataclass
class StepStats:
    """What the last step cost this rank: wall time, time blocked waiting for messages, and activation memory."""

    step_s: float = 0.0
    wait_s: float = 0.0
    peak_in_flight: int = 0  # most micro-batches whose forward has run and backward (zb1: W) has not


class PipelineSchedule:
    """Runs one rank's action list: forwards and backwards of its chunks, sends and receives to neighbours.

    Activations and gradients between stages have the shape (micro-batch, seq / seq_shards, dim) — seq_shards
    is the tp size under sequence parallelism — and the dtype of the residual stream (the parameter dtype;
    autocast does not change it), so every receive buffer is allocated before the data arrives. Messages
    between two ranks match in order; the schedule guarantees the order. Every wait is bounded by the
    process group's timeout (`parallel.timeout_s`): a dead or stuck neighbour raises PipelineError.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        pp_group: dist.ProcessGroup,
        schedule: str = "1f1b",
        n_micro: int = 1,
        loss_fn: LossFn | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        set_grad_sync: Callable[[int, bool], None] | None = None,
        seq_shards: int = 1,
        hidden_size: int | None = None,
    ) -> None:
        self.chunks = chunks
        self.group = pp_group
        self.rank, self.size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.peers = [dist.get_global_rank(pp_group, r) for r in range(self.size)]
        self.n_micro = n_micro
        self.n_stages = self.size * len(chunks)
        self.loss_fn = loss_fn or (lambda out, targets: cross_entropy_loss(out, targets) / n_micro)
        self.autocast = autocast
        self.set_grad_sync = set_grad_sync or (lambda chunk, enabled: None)
        self.seq_shards = seq_shards
        self.actions = build_schedule(schedule, self.size, n_micro, len(chunks))[self.rank]
        self.eval_actions = build_schedule(schedule, self.size, n_micro, len(chunks), forward_only=True)[self.rank]
        self.dim = hidden_size or chunks[0].cfg.dim
        self.stats = StepStats()

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype between stages: the working weights' (read when running: a meta-built model
        is materialised, and ZeRO may hold bf16 working weights, after the schedule is made)."""
        return next(self.chunks[0].parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    def stage(self, chunk: int) -> int:
        return chunk * self.size + self.rank

    def train_step(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward and backward every micro-batch; gradients accumulate in the chunks' parameters.

        `loss_fn(output, targets)` gives a micro-batch's term of the step's loss (ParallelModel: its kept-token
        loss sum over the step's global kept-token count; by default the micro-batch's mean / n_micro).
        Returns Σ of the terms on the last stage and 0 elsewhere.
        """
        return self._run(self.actions, micro_inputs, micro_targets, train=True)

    @torch.no_grad()
    def eval_step(self, micro_inputs: Sequence[torch.Tensor], micro_targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward only; Σ of the micro-batches' loss terms on the last stage, 0 elsewhere."""
        return self._run(self.eval_actions, micro_inputs, micro_targets, train=False)

    def broadcast_from_last_stage(self, loss: torch.Tensor) -> None:
        """Overwrite `loss` in place with the last stage's value, so every rank reports the same number."""
        with comm("broadcast"):
            dist.broadcast(loss, src=self.peers[-1], group=self.group)

    # ---- the loop -------------------------------------------------------------------------------------
    def _run(
        self, actions: list[Action], inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], train: bool
    ) -> torch.Tensor:
        if len(inputs) != self.n_micro:
            raise ValueError(f"pipeline built for {self.n_micro} micro-batches, got {len(inputs)}")
        start = time.perf_counter()
        self.stats = StepStats()
        split = any(a.kind == "W" for a in actions)  # zero-bubble: weight gradients are a pass of their own
        weights = "W" if split else "B"
        last_backward = {a.chunk: a.micro for a in actions if a.kind == weights}  # the one that triggers dp sync
        total = torch.zeros((), device=self.device)
        self._outbox: dict[Key, torch.Tensor] = {}  # computed, waiting for its send action
        self._inbox: dict[Key, tuple[dist.Work, torch.Tensor, Action]] = {}  # posted receives
        self._sends: dict[Key, tuple[dist.Work, Action]] = {}  # posted sends, until their WAIT
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (chunk, micro) -> in, out
        deferred: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}  # -> out, its gradient
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.kind in WAITS:
                self._wait(*self._sends.pop((a.kind[-1], a.chunk, a.micro)))
                i += 1
                continue
            if a.kind not in COMPUTE:
                j = i
                while j < len(actions) and actions[j].kind not in COMPUTE + WAITS:
                    j += 1
                self._post(actions[i:j], inputs)
                i = j
                continue
            stage = self.stage(a.chunk)
            if a.kind == "F":
                x = inputs[a.micro] if stage == 0 else self._receive(("F", a.chunk, a.micro))
                if train and stage > 0:
                    x.requires_grad_()
                with self.autocast():
                    out = self.chunks[a.chunk](x)
                    if stage == self.n_stages - 1:
                        out = self.loss_fn(out, targets[a.micro]).float()
                if stage == self.n_stages - 1:
                    total += out.detach()
                else:
                    self._check_shape(out, inputs[a.micro], a)
                    self._outbox[("F", a.chunk, a.micro)] = out.detach()
                if train:
                    saved[(a.chunk, a.micro)] = (x if stage > 0 else None, out)
                    self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(saved) + len(deferred))
            elif a.kind == "W":
                out, grad = deferred.pop((a.chunk, a.micro))
                self.set_grad_sync(a.chunk, a.micro == last_backward[a.chunk])
                params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]
                torch.autograd.backward(out, grad, inputs=params)
            else:
                x, out = saved.pop((a.chunk, a.micro))
                grad = None if stage == self.n_stages - 1 else self._receive(("B", a.chunk, a.micro))
                if split:  # the input gradient only, now; the graph stays for W
                    if x is not None:
                        (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
                    deferred[(a.chunk, a.micro)] = (out, grad)
                else:
                    self.set_grad_sync(a.chunk, a.micro == last_backward[a.chunk])
                    torch.autograd.backward(out, grad)
                if x is not None:
                    self._outbox[("B", a.chunk, a.micro)] = x.grad
            i += 1
        self.stats.step_s = time.perf_counter() - start
        return total

    def _post(self, batch: list[Action], inputs: Sequence[torch.Tensor]) -> None:
        """Issue a run of consecutive sends and receives as one batch of asynchronous point-to-point ops."""
        ops = []
        for a in batch:
            if a.kind in SENDS:
                tensor = self._outbox.pop((a.kind[-1], a.chunk, a.micro))
                ops.append(dist.P2POp(dist.isend, tensor, self.peers[a.peer], self.group))
            else:
                buffer = torch.empty(self._hidden_shape(inputs[a.micro]), dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.peers[a.peer], self.group))
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # a neighbour's connection already closed
            raise PipelineError(f"{self._where(batch[0])}: posting {self._what(batch[0])} failed: {e}") from e
        for a, op, work in zip(batch, ops, works, strict=True):
            if a.kind in SENDS:
                self._sends[(a.kind[-1], a.chunk, a.micro)] = (work, a)
            else:
                self._inbox[(a.kind[-1], a.chunk, a.micro)] = (work, op.tensor, a)

    def _receive(self, key: Key) -> torch.Tensor:
        work, tensor, a = self._inbox.pop(key)
        self._wait(work, a)
        return tensor

    def _wait(self, work: dist.Work, a: Action) -> None:
        start = time.perf_counter()
        try:
            with bubble() if a.kind not in SENDS else comm("p2p"):
                work.wait()  # bounded by the process group's timeout
        except Exception as e:  # raised on timeout and when the neighbour's connection closes
            raise PipelineError(
                f"{self._where(a)}: {self._what(a)} failed after {time.perf_counter() - start:.1f}s: {e}"
            ) from e
        self.stats.wait_s += time.perf_counter() - start

    def _hidden_shape(self, micro_input: torch.Tensor) -> tuple[int, ...]:
        batch, seq = micro_input.shape[:2]
        return (batch, seq // self.seq_shards, self.dim)

    def _check_shape(self, out: torch.Tensor, micro_input: torch.Tensor, a: Action) -> None:
        expected = self._hidden_shape(micro_input)
        if tuple(out.shape) != expected or out.dtype != self.dtype:
            raise PipelineError(
                f"{self._where(a)}: output of micro-batch {a.micro} is {tuple(out.shape)} {out.dtype}, but the "
                f"next stage expects {expected} {self.dtype} (micro-batch × seq/seq_shards × dim)"
            )

    def _where(self, a: Action) -> str:
        return f"pipeline stage {self.stage(a.chunk)} (pp rank {self.rank}, chunk {a.chunk})"

    @staticmethod
    def _what(a: Action) -> str:
        what = "activation" if a.kind.endswith("F") else "gradient"
        if a.kind.startswith("SEND"):
            return f"sending the {what} of micro-batch {a.micro} to pp rank {a.peer}"
        return f"receiving the {what} of micro-batch {a.micro} from pp rank {a.peer}"
