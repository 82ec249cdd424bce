"""ParallelModel: a plain model as one rank holds it under a layout — what a training loop sees of parallelism.

Composition: each parallelism is a strategy in a folder of its own (listed in meshlm.parallel.strategies) with one
contract (meshlm.parallel.contract) — check the layout, check the model against its plan, apply — and
`ParallelModel` applies the transforms of the plain model (freezing and LoRA), runs every strategy's check, then
applies the others in order (tensor parallel, the fused loss, context parallel, expert parallel, pipeline, data
parallel / ZeRO, FP8, compile), each driven by the model's ParallelPlan (meshlm.parallel.parallel_plan), never by
its attribute names. None touches the model code. Each applied strategy returns its run-time hooks (an Applied: the
batch split, the micro-batches, the gradient synchronisation, gathering the state) and hands on its products through
it (the pipeline's stages, data parallel's gradients' owner, tensor parallel's loss); the run-time methods below
keep the loss contract and run those hooks in order, naming no parallelism, passing them what they act on (a batch,
the gradients' owner, this rank's parameters), never itself. The pipeline calls back into a step through a
StepContext (the scaled loss, autocast, the grad-sync switch). The gradients and optimizer tensors have one owner
(`grads`, meshlm.parallel.dp.gradients). Every gradient is correct after `forward_backward` (or `backward`) returns,
so clipping and the optimizer are layout-agnostic, and any torch.optim optimizer steps what `parameters()` returns.

A model built on the `meta` device goes through the module swaps and the pipeline split as meta tensors; then
each rank allocates only what it keeps (its tp slice of its stage, under ZeRO-3 only its flat shard), directly
in the working dtype, and initialises it element by element (meshlm.parallel.materialize): set-up memory is the shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.llama import token_cross_entropy
from meshlm.model.moe import set_aux_loss_scale
from meshlm.parallel.contract import Applied, Build, LayoutSpec, LossFn, StepContext
from meshlm.parallel.distributed import AUTOCAST_DTYPES
from meshlm.parallel.dp.gradients import ShardedTensor
from meshlm.parallel.materialize import MetaInit, is_meta_model
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.meta import MetaFailure, meta_forward, meta_tokens
from meshlm.parallel.options import LoRAOptions, Loss, ParallelOptions
from meshlm.parallel.parallel_plan import ParallelPlan, PlanError
from meshlm.parallel.placement import Placements
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.strategies import apply_strategies, check_layout
from meshlm.parallel.timers import comm
from meshlm.parallel.transforms.fp8 import check_fp8_device
from meshlm.parallel.transforms.fused_loss import HeadOutput, fused_cross_entropy_sum
from meshlm.parallel.transforms.lora import Adaptation
from meshlm.ties import tied_aliases


def mesh_device(mesh: Mesh) -> torch.device:
    """The device this rank computes on: its current GPU under a CUDA mesh, else the CPU."""
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_mesh.device_type)


class LossShapeError(PlanError):
    """A loss function that does not return one loss per target token."""


def check_token_losses(losses: object, targets: torch.Tensor) -> None:
    """The loss contract: one loss per target token, shaped like the targets (LossShapeError otherwise)."""
    if not torch.is_tensor(losses) or losses.shape != targets.shape:
        got = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
        raise LossShapeError(
            f"loss_fn returned {got}, but meshlm needs one loss per target token, shaped like the targets "
            f"{tuple(targets.shape)} (e.g. F.cross_entropy(..., reduction='none')): it averages them over "
            "the kept tokens of the global batch itself"
        )


def check_loss_shape(model: nn.Module, loss_fn: LossFn) -> None:
    """The loss contract checked before any work: the model and `loss_fn` run once on a meta batch
    (meshlm.parallel.meta), on every rank alike, so a scalar loss is one line, not a failure of the last
    pipeline stage at the first step. A model or loss that the meta device cannot run is checked at the step."""
    targets = meta_tokens()
    losses = meta_forward(model, meta_tokens(), then=lambda output: loss_fn(output, targets))
    if not isinstance(losses, MetaFailure):
        check_token_losses(losses, targets)


class ParallelModel:
    """This rank's model chunks plus the collectives that make them behave like the single-process model.

    Built by `parallelize` below, the one door for the library (`meshlm.parallelize`) and meshlm's trainer alike.
    `options` are the engine's options (meshlm.parallel.options.ParallelOptions: the strategies', the step's
    micro-batches and autocast dtype, FP8 and compile after the parallel transforms); `plan` defaults to the
    registered plan of the model's class (meshlm.parallel.parallel_plan.plan_for); `adaptation` (train.freeze and LoRA,
    meshlm.parallel.transforms.lora) is applied to the plain model before anything else.

    The loss contract (`loss`, a meshlm.parallel.options.Loss): `loss.fn(output, targets)` returns per-token
    losses shaped like `targets` (as `F.cross_entropy(..., reduction="none")` does); meshlm zeroes those whose
    target is `loss.ignore_index`, sums them and divides by the number of kept tokens in the *global* batch
    (every replica and micro-batch), so the loss and gradients equal one process's `sum(loss over kept tokens) /
    count(kept tokens)` under any layout and accumulation. The default is token cross-entropy,
    vocabulary-parallel under tp (the logits stay sharded). A loss of one's own under tp needs
    `loss.gather_logits` (the model then returns full logits, at the cost of gathering them). `loss.fused`
    computes meshlm's cross-entropy together with the vocabulary head, chunk by chunk, never materialising the
    logits (meshlm.parallel.transforms.fused_loss; the head returns them again in eval). `model` may be built on
    the `meta` device: each rank then materialises only its shard (see the module docstring), on the mesh's device."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        options: ParallelOptions,
        plan: ParallelPlan | None = None,
        loss: Loss | None = None,
        adaptation: Adaptation | None = None,
    ) -> None:
        loss = loss or Loss()
        self.mesh = mesh
        self.options, self.loss = options, loss
        self.n_micro = n_micro = options.micro_batches
        self.ignore_index = loss.ignore_index
        self._tokens_scale: torch.Tensor | None = None  # replicas / global kept tokens, set per step
        self.autocast_dtype = AUTOCAST_DTYPES.get(options.autocast_dtype)
        self.plan = plan = plan or plan_for(model)
        self.placements = Placements()  # filled by the strategies (meshlm.parallel.placement)
        meta = is_meta_model(model)
        self.device_type = mesh_device(mesh).type if meta else next(model.parameters()).device.type
        build = Build(
            model,
            mesh,
            options,
            plan,
            step=StepContext(self._scaled_loss, self.autocast, self.set_grad_sync),
            meta_init=None,
            device_type=self.device_type,
            loss=loss,
            adaptation=adaptation or Adaptation(),
            placements=self.placements,
        )
        self.applied: list[Applied] = apply_strategies(build, model_transforms=True).applied  # freezing, LoRA first
        layout = mesh.layout
        check_layout(LayoutSpec(None, layout, n_micro * layout.data_parallel, 1, options=options), model, plan)
        if layout.tp > 1 and loss.fn is not None and not loss.gather_logits:
            raise PlanError(
                "loss_fn: under tp the model's logits are sharded over the vocabulary; a loss of one's own needs "
                "gather_logits=True (meshlm.Loss(fn, gather_logits=True) for meshlm.parallelize, gather_logits=True "
                "for meshlm.fit), or leave loss_fn unset for meshlm's vocabulary-parallel cross-entropy"
            )
        if loss.fn is not None and not loss.fused:
            check_loss_shape(model, loss.fn)
        self.global_shapes = {name: p.shape for name, p in model.named_parameters()}
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}  # global names
        self.tied_aliases = tied_aliases(model)  # a tied weight is named by its canonical name (meshlm.ties)
        meta_init = MetaInit(model, mesh_device(mesh), self.placements) if meta else None
        done = apply_strategies(dataclasses.replace(build, meta_init=meta_init))  # in composition order
        self.applied += done.applied  # their run-time hooks
        self.chunks, self.grads = done.chunks, done.grads  # what the strategies handed on
        self.token_loss = done.token_loss or loss.fn or self._cross_entropy
        self.replicas = mesh.size("replicas")  # ranks whose gradients are averaged: dp × ep × cp
        self.across = None  # fault-tolerant replica groups' reductions (meshlm.parallel.dp.replica_groups.attach)
        # for inspection (tests, benchmarks): the schedule and the data-parallel object, None when unused
        self.pipeline, self.dp = done.parts.get("pipeline"), done.parts.get("dp")
        for chunk in self.chunks:  # MoE aux losses: each micro-batch's share, like the loss's / n_micro
            set_aux_loss_scale(chunk, 1.0 / n_micro)

    # ---- the loss: per-token losses over the kept tokens of the global batch ---------------------------
    def count_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """The number of kept targets (not `ignore_index`) in `targets` summed over every replica (dp, ep, and
        cp shards of the sequences): the denominator of the global-batch token mean. One all-reduce of a scalar;
        every replica must call it. A device tensor, no host sync."""
        count = (targets != self.ignore_index).sum().to(torch.float32)
        if self.replicas > 1:
            with comm("all_reduce"):
                dist.all_reduce(count, group=self.mesh.group("replicas"))
        if self.across is not None:  # and over the live replica groups: the loss scale follows them
            self.across.sum_(count)
        return count

    def _cross_entropy(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(getattr(output, "logits", output), targets, self.ignore_index)

    def token_loss_sum(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        """Σ of the loss function's per-token losses over the kept targets, in fp32 (fused with the output
        projection, chunk by chunk, when the head returned a HeadOutput: `fused_loss`)."""
        head = getattr(output, "logits", output)
        if isinstance(head, HeadOutput):
            return fused_cross_entropy_sum(head, targets, self.ignore_index)
        losses = self.token_loss(output, targets)
        check_token_losses(losses, targets)
        return torch.where(targets != self.ignore_index, losses.float(), 0.0).sum()

    def loss_fn(
        self, output: object, targets: torch.Tensor, num_tokens: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """This rank's share of the global-batch token-mean loss, for a loop of one's own: Σ per-token loss
        over its kept targets × replicas / `num_tokens`, so that data parallel's gradient average gives the
        gradient of Σ loss / num_tokens over the whole batch. `num_tokens` is the number of kept tokens in the
        global batch of the optimizer step (`count_tokens` of all the step's targets — pass it when
        accumulating over micro-batches); by default `count_tokens(targets)`, the step being this one batch.
        `replica_mean` of the result is the global loss."""
        if num_tokens is None:
            num_tokens = self.count_tokens(targets)
        count = torch.as_tensor(num_tokens, dtype=torch.float32, device=targets.device).clamp(min=1)
        return self.token_loss_sum(output, targets) * (self.replicas / count)

    def _scaled_loss(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's term of the step's loss (the pipeline's loss function): its kept-token loss sum
        times replicas / the step's global kept tokens, set by `_start_step`."""
        return self.token_loss_sum(output, targets) * self._tokens_scale

    def _start_step(self, targets: torch.Tensor) -> None:
        self._tokens_scale = self.replicas / self.count_tokens(targets).clamp(min=1)

    def _check_batch(self, inputs: torch.Tensor) -> None:
        """The batch splits into the micro-batches, and every applied strategy takes it (data parallel: each
        replica got rows of its own)."""
        if inputs.shape[0] % self.n_micro:
            raise PlanError(
                f"forward_backward: {inputs.shape[0]} rows do not split into {self.n_micro} micro-batches; "
                f"pass a multiple of {self.n_micro} rows (this replica's share of the global batch)"
            )
        for hooks in self.applied:
            hooks.check_batch(inputs)

    # ---- helpers the strategies share -------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        """Whether the next backward of `chunk` should reduce gradients across replicas (last micro-batch only)."""
        for hooks in self.applied:
            hooks.set_grad_sync(chunk, enabled)

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    # ---- one optimizer step's worth of work ---------------------------------------------------------
    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn | None = None
    ) -> torch.Tensor:
        """Run every micro-batch of this replica's batch (any layout, pipeline included); return the
        global-batch mean loss on every rank. `loss_fn` replaces the model's per-token loss for this call
        (under tp it needs `Loss(gather_logits=True)`; a head fused with meshlm's loss computes no other)."""
        if loss_fn is not None:
            if self.loss.fused and self.loss.fn is None and not self.loss.gather_logits:
                raise PlanError(
                    "forward_backward(loss_fn): the head computes meshlm's cross-entropy fused (Loss(fused=True)) "
                    "and returns no logits; give the loss to parallelize instead (loss=meshlm.Loss(fn))"
                )
            if self.mesh.layout.tp > 1 and not self.loss.gather_logits:
                raise PlanError(
                    "forward_backward(loss_fn): under tp the model's logits are sharded over the vocabulary; a "
                    "loss of one's own needs meshlm.Loss(gather_logits=True) given to parallelize"
                )
            previous, self.token_loss = self.token_loss, loss_fn
            try:
                return self.forward_backward(inputs, targets)
            finally:
                self.token_loss = previous
        self._start_backward()
        self.train(True)
        self._check_batch(inputs)
        inputs, targets = self.seq_shard(inputs), self.seq_shard(targets)
        self._start_step(targets)
        micro_inputs, micro_targets = inputs.chunk(self.n_micro), targets.chunk(self.n_micro)
        loss = self._run_hooks(micro_inputs, micro_targets, train=True)
        if loss is None:
            model = self.chunks[0]
            loss = torch.zeros((), device=inputs.device)
            for i, (x, y) in enumerate(zip(micro_inputs, micro_targets, strict=True)):
                self.set_grad_sync(0, i == self.n_micro - 1)
                with self.autocast():
                    micro_loss = self._scaled_loss(model(x), y)
                micro_loss.backward()
                loss += micro_loss.detach()
        self._end_backward(step=True)
        return self.replica_mean(loss)

    def _run_hooks(
        self, micro_inputs: tuple[torch.Tensor, ...], micro_targets: tuple[torch.Tensor, ...], train: bool
    ) -> torch.Tensor | None:
        """This rank's loss from the first applied strategy that runs the micro-batches itself; None if none does."""
        for hooks in self.applied:
            loss = hooks.run_micro_batches(micro_inputs, micro_targets, train)
            if loss is not None:
                return loss
        return None

    def _start_backward(self) -> None:
        for hooks in self.applied:
            hooks.start_backward()

    def _end_backward(self, step: bool) -> None:
        """The applied strategies' gradient hooks, last applied first (data parallel reduces before anything
        acts on the reduced gradients)."""
        for hooks in reversed(self.applied):
            hooks.end_backward(step, self.grads)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward-only loss of this replica's batch, averaged over replicas."""
        self.train(False)
        inputs, targets = self.seq_shard(inputs), self.seq_shard(targets)
        self._start_step(targets)
        loss = self._run_hooks(inputs.chunk(self.n_micro), targets.chunk(self.n_micro), train=False)
        if loss is None:
            with self.autocast():
                loss = self._scaled_loss(self.chunks[0](inputs), targets)
        return self.replica_mean(loss)

    def replica_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of a per-replica scalar over data-parallel replicas and cp ranks (from the last stage
        under pp). Each holds its kept-token loss sum × replicas / the global kept tokens (`loss_fn`), so
        their mean is the global-batch token mean."""
        loss = loss.detach().float().clone()
        for hooks in self.applied:
            hooks.share_loss(loss)
        if self.replicas > 1:
            with comm("all_reduce"):
                dist.all_reduce(loss, group=self.mesh.group("replicas"))
            loss /= self.replicas
        if self.across is not None:  # each group's share of the live groups' token mean
            self.across.sum_(loss)
        return loss

    # ---- a loop of one's own: forward, backward, no_sync, step ------------------------------------------
    def __call__(self, *args: object, **kwargs: object) -> object:
        """The model's forward on this rank (not under pipeline parallelism: use `forward_backward`)."""
        for hooks in self.applied:
            hooks.check_direct_call()
        with self.autocast():
            return self.chunks[0](*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), then (outside `no_sync`) wait for the overlapped gradient reduction to finish."""
        self._start_backward()
        loss.backward()
        self._end_backward(step=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside only accumulate, with no communication; the first
        `backward` after it reduces the accumulated gradients once."""
        for chunk in range(len(self.chunks)):
            self.set_grad_sync(chunk, False)
        try:
            yield
        finally:
            for chunk in range(len(self.chunks)):
                self.set_grad_sync(chunk, True)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), then what the layout needs after it (ZeRO-1/2 gather the new weights), then
        zero_grad: the one call that replaces `optimizer.step(); optimizer.zero_grad()`."""
        optimizer.step()
        self.after_optimizer_step()
        self.zero_grad()

    def seq_shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This cp rank's load-balanced chunks of every row (meshlm.parallel.cp.attention), which
        `forward_backward` and `eval_loss` take themselves; without context parallel the rows unchanged."""
        for hooks in self.applied:
            batch = hooks.shard_sequence(batch)
        return batch

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel replica's rows of a global batch (dp × ep ranks each get their own; the same on
        every tp / pp / cp rank: a loop of one's own calling the model directly under cp passes it `seq_shard`
        of them)."""
        for hooks in self.applied:
            batch = hooks.local_rows(batch)
        return batch

    # ---- optimizer interface ------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model parameters this rank holds (tp shards, its pipeline stages), under the model's names."""
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                yield self.tied_aliases.get(name, name), p

    def parameters(self) -> list[nn.Parameter]:
        """What an optimizer must step: the parameters, or under ZeRO this rank's fp32 master shards."""
        return [p for group in self.optimizer_param_groups(0.0) for p in group["params"]]

    def named_optimizer_tensors(self) -> list[tuple[str, nn.Parameter]]:
        """(parameter name, tensor) for each tensor `parameters()` gives the optimizer; under ZeRO the pieces
        of this rank's master shards, each under the name of the parameter it is a piece of."""
        return [(self.tied_aliases.get(name, name), t) for name, t in self.grads.named_steps()]

    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        """Matrices decay, vectors (norm weights, biases) do not; under ZeRO the groups hold flat shards."""
        return self.grads.optimizer_param_groups(weight_decay)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the true global norm: every gradient element counted once over the whole world.
        Stays on the device, no host sync: a non-finite norm leaves the gradients unscaled (coefficient 1)."""
        device = next(self.chunks[0].parameters()).device
        sq = self.grads.grad_sq_sum(skip=self._not_counted).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with comm("all_reduce"):
                dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if max_norm > 0:
            coef = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
            self.grads.scale_grads_(coef)
        return norm

    def after_optimizer_step(self) -> None:
        """What the gradients' owner does after the optimizer stepped (ZeRO-1/2: all-gather the new weights)."""
        self.grads.after_optimizer_step()

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    # ---- state for checkpoints ----------------------------------------------------------------------
    def local_shards(
        self, optimizer: torch.optim.Optimizer | None = None, writer: bool = False, frozen: bool = False
    ) -> dict[str, list[ShardedTensor]]:
        """Pieces of fp32 state this rank holds, as flat views into live storage: 'model' (ZeRO masters or the
        parameters) and, given the optimizer, each of its per-element states (optimizer_state_keys). A
        piece's shape and offset are within the parameter as this rank holds it (its tp slice). All of them by
        default (what a load fills); with `writer`, only this rank's share of what is replicated, so that
        over all ranks every element is written once and the writing is spread over the replicas (dp
        copies, tp-replicated norms). Frozen parameters (requires_grad False: a LoRA base) are not training
        state and are left out; `frozen` (to load a base into, not to save) gives them too, whole, as held."""
        if frozen and writer:
            raise ValueError("frozen parameters are loaded, never saved, from here")
        out = self.grads.sharded_state_dict(optimizer, replicas="spread" if writer else "all")
        aliases = self.tied_aliases
        out = {
            key: [ShardedTensor(aliases.get(s.name, s.name), s.global_shape, s.offset, s.local) for s in pieces]
            for key, pieces in out.items()
        }
        if frozen:  # ZeRO-3 shards frozen parameters too: their pieces are the masters'
            out["model"] += self.grads.frozen_shards()
            seen = {id(p) for buf in self.grads.frozen_buffers for p in buf.params}
            for name, p in self.named_parameters():
                if not p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out["model"].append(ShardedTensor(name, p.shape, 0, p.detach().view(-1)))
        if writer:
            params = dict(self.named_parameters())
            out = {key: [s for s in pieces if not self._not_counted(params[s.name])] for key, pieces in out.items()}
        return out

    def _not_counted(self, param: nn.Parameter) -> bool:
        """Another rank counts this parameter's gradient-norm term and writes it (Placement.counted)."""
        return not self.placements[param].counted

    def after_load(self) -> None:
        """Refresh the working weights from freshly loaded fp32 masters (ZeRO-1/2 all-gather them; ZeRO-3
        gathers from the masters before each use anyway)."""
        self.after_optimizer_step()

    # ---- gathering the whole model ------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights under the model's names, on every rank (tests, export, generation)."""
        state = self.grads.unsharded_state_dict()
        held = {n: p for chunk in self.chunks for n, p in chunk.named_parameters(remove_duplicate=False)}
        for hooks in self.applied:  # each gathers what it split over its mesh dimension, in order
            state = hooks.gather_state(state, held)
        return state


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    options: ParallelOptions | dict[str, Any] | None = None,
    *,
    plan: ParallelPlan | None = None,
    loss: Loss | None = None,
    lora: LoRAOptions | dict[str, Any] | None = None,
    freeze: Sequence[str] = (),
    lora_seed: int = 0,
) -> ParallelModel:
    """Apply the mesh's layout to `model` in place, as `plan` (default: the plan registered for the model's
    class, else DP/ZeRO only) says: tensor parallel, then pipeline stages, then data parallel / ZeRO. The one
    door into ParallelModel: `meshlm.parallelize` is this function, and meshlm's trainer calls it too
    (meshlm.train.startup.build_parallel_model), with the options its run config sets.

    `options` are the engine's options (meshlm.parallel.options.ParallelOptions, or a dict of its fields,
    `{"zero": 1, "micro_batches": 4}`, validated with one-line InputErrors naming the field; None is the
    defaults): the run config's `[parallel]` options (ZeRO stage, pipeline schedule, sequence parallelism,
    context-parallel attention...), `micro_batches` (how many micro-batches `forward_backward` cuts this
    replica's batch into: gradient accumulation; under pp the pipeline's micro-batches), `autocast_dtype`
    ("bf16", "fp16"; None: fp32), `fp8` (True: the blocks' Linear layers multiply in fp8 on an FP8 GPU;
    "emulate" runs the same quantisation anywhere) and `compile` (torch.compile each block with
    `compile_backend`), both after the parallel transforms, as `train.fp8` and `train.compile` do.
    Every rank must build `model` with the same weights (same seed) before calling this, or build it on the
    `meta` device (`with torch.device("meta"): model = MyModel()`): then each rank allocates and initialises
    only its own shard, from the model's `init_rule` (meshlm's Llama: the weights of a one-process build,
    bit for bit) or else each module's `reset_parameters()` (see meshlm.parallel.materialize). The plan is
    checked first; a mismatch raises a one-line PlanError naming the module, with the model untouched.
    `loss` (a Loss; default: token cross-entropy) is what `forward_backward` averages over the targets that
    are not `loss.ignore_index` in the whole global batch; `Loss(gather_logits=True)` gives a tp model full
    logits for a loss of one's own, `Loss(fused=True)` computes the default loss with the vocabulary head,
    chunk by chunk. Under a `cp` mesh dimension `forward_backward` takes full rows, the model itself
    `seq_shard` of them. `freeze` (parameter-name patterns) and `lora` (a LoRAOptions, or a dict of its fields:
    `{"rank": 8}`, the adapters' A drawn from `lora_seed`) freeze and adapt the model first, as `train.freeze`
    and `[lora]` do (docs/lora.md)."""
    options = ParallelOptions.of(options)
    if isinstance(lora, dict):
        lora = LoRAOptions(**lora)
    adaptation = Adaptation(tuple(freeze), lora or LoRAOptions(), lora_seed)
    device = mesh_device(mesh)
    if options.fp8 is True:
        check_fp8_device(device)
    if device.type == "cuda" and not is_meta_model(model):
        model.to(device)
    return ParallelModel(model, mesh, options, plan, loss, adaptation)
