"""ParallelModel: a plain model as one rank holds it under a layout — what a training loop sees of parallelism.

Composition order (each step transforms the output of the previous one, none touches the model code), each
driven by the model's ParallelPlan (meshlm.parallel.plan), never by its attribute names:
  1. tensor parallel  swaps the Linear/Embedding modules the plan names for sharded ones on the `tp` group;
  2. pipeline         keeps only this rank's stage(s) of the plan's layers on the `pp` group;
  3. data parallel    / ZeRO owns gradient reduction and parameter / optimizer sharding on `dp`.
Every gradient is correct after `forward_backward` (or `backward`) returns, so clipping and the optimizer
are layout-agnostic, and any torch.optim optimizer steps what `parameters()` returns.

A model built on the `meta` device goes through steps 1 and 2 as meta tensors; then each rank allocates
only what it keeps (its tp slice of its stage, under ZeRO-3 only its flat shard), directly in the working
dtype, and initialises it element by element (meshlm.parallel.materialize): set-up memory is the shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import ParallelSection
from meshlm.model.llama import cross_entropy_loss
from meshlm.observe.timers import comm
from meshlm.parallel.data_parallel import ShardedTensor, squared_norm_sum
from meshlm.parallel.materialize import MetaInit, is_meta_model
from meshlm.parallel.mesh import Mesh
from meshlm.parallel.plan import ParallelPlan, check_plan, plan_for

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_tp_replicated(param: nn.Parameter) -> bool:
    """True for parameters whose gradient is counted on another tp rank too (norm weights, and every copy
    but the first of a KV head replicated over ranks): the global norm counts them on tp rank 0 only."""
    return getattr(param, "_meshlm_tp_shard_dim", None) is None


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's per-element state (AdamW: exp_avg, exp_avg_sq; SGD: momentum_buffer): the tensors
    shaped like their parameter, which are sharded with it. Scalars (step counts) are not."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape and v.ndim)
    return []


def mesh_device(mesh: Mesh) -> torch.device:
    """The device this rank computes on: its current GPU under a CUDA mesh, else the CPU."""
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_mesh.device_type)


def zero_param_dtype(parallel: ParallelSection, device_type: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The working weights' dtype over fp32 master shards: `parallel.zero_param_dtype`, where 'auto' is bf16
    under ZeRO ≥ 1 with bf16 autocast on CUDA (FSDP2's usual MixedPrecisionPolicy: the matmuls run in bf16
    anyway, so gathers of bf16 weights halve the traffic and memory), else fp32 (zero 0 steps the fp32
    weights themselves)."""
    choice = parallel.zero_param_dtype
    if choice == "auto":
        cuda_bf16 = device_type == "cuda" and autocast_dtype == torch.bfloat16
        choice = "bf16" if parallel.zero >= 1 and cuda_bf16 else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def replica_group(mesh: Mesh) -> dist.ProcessGroup:
    """The ranks that hold the same weights and reduce gradients together: dp, and under context parallel
    dp × cp (each cp rank's gradient covers only its tokens of the sequences)."""
    return mesh.group("dp_cp")


def causal_lm_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits, or of an output object's `.logits` (Hugging Face models)."""
    return cross_entropy_loss(getattr(output, "logits", output), targets)


class ParallelModel:
    """This rank's model chunks plus the collectives that make them behave like the single-process model.

    `plan` defaults to the registered plan of the model's class (meshlm.parallel.plan.plan_for). `loss_fn`
    maps (model output, targets) to a mean loss; by default token cross-entropy, vocabulary-parallel under
    tp (the logits stay sharded). `gather_logits` makes a tp model return full logits instead, for a loss
    of one's own that needs them (at the cost of gathering them). `model` may be built on the `meta`
    device: each rank then materialises only its shard (see the module docstring), on the mesh's device."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        parallel: ParallelSection,
        n_micro: int,
        autocast_dtype: torch.dtype | None = None,
        plan: ParallelPlan | None = None,
        loss_fn: LossFn | None = None,
        gather_logits: bool = False,
    ) -> None:
        self.mesh = mesh
        self.n_micro = n_micro
        self.autocast_dtype = autocast_dtype
        self.plan = plan = plan or plan_for(model)
        layout = mesh.layout
        check_plan(model, plan, layout.tp, layout.pp, parallel.zero, parallel.sequence_parallel)
        self.global_shapes = {name: p.shape for name, p in model.named_parameters()}
        meta_init = MetaInit(model, mesh_device(mesh)) if is_meta_model(model) else None
        self.device_type = meta_init.device.type if meta_init else next(model.parameters()).device.type
        if layout.pp > 1:
            from meshlm.parallel.pipeline import hidden_size

            width = hidden_size(model, plan.pipeline)  # read before tp swaps the embedding
        self.loss_fn: LossFn = loss_fn or causal_lm_loss

        if layout.tp > 1:
            from meshlm.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

            tp_state = apply_tensor_parallel(model, mesh.group("tp"), parallel.sequence_parallel, plan)
            for m in model.modules():
                if getattr(m, "vocab_head", False):
                    m.gather_output = gather_logits
            if loss_fn is None and not gather_logits:

                def tp_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
                    return vocab_parallel_cross_entropy(getattr(output, "logits", output), targets, tp_state.group)

                self.loss_fn = tp_loss

        if layout.cp > 1:
            from meshlm.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(model, plan, mesh.group("cp"), parallel.cp_attention)

        self.pipeline = None
        if layout.pp > 1:
            from meshlm.parallel.pipeline import split_model

            self.chunks: list[nn.Module] = split_model(
                model, mesh.rank("pp"), layout.pp, parallel.virtual_stages, plan=plan
            )
        else:
            self.chunks = [model]
        packed = layout.dp * layout.cp > 1 or parallel.zero > 0  # data parallel / ZeRO lays the parameters out
        if meta_init is not None:
            meta_init.replace_params(model, self.chunks, packed)

        if layout.pp > 1:
            from meshlm.parallel.pipeline import PipelineSchedule

            self.pipeline = PipelineSchedule(
                self.chunks,
                mesh.group("pp"),
                schedule=parallel.schedule,
                n_micro=n_micro,
                loss_fn=self._staged_loss,
                autocast=self.autocast,
                set_grad_sync=self.set_grad_sync,
                seq_shards=layout.tp if parallel.sequence_parallel else 1,
                hidden_size=width,
            )

        self.dp = None
        if packed:
            from meshlm.parallel.data_parallel import DataParallel

            self.dp = DataParallel(
                self.chunks,
                replica_group(mesh),
                zero=parallel.zero,
                bucket_mb=parallel.bucket_mb,
                shard_group_size=parallel.zero_shard_size,
                param_dtype=zero_param_dtype(parallel, self.device_type, autocast_dtype),
                reduce_dtype=torch.bfloat16 if parallel.zero_reduce_dtype == "bf16" else torch.float32,
                plan=plan,
                source=meta_init,
            )
        if meta_init is not None:
            meta_init.check_done()

    def _staged_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, targets)

    # ---- helpers the strategies share -------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def set_grad_sync(self, chunk: int, enabled: bool) -> None:
        """Whether the next backward of `chunk` should reduce gradients across dp (last micro-batch only)."""
        if self.dp is not None:
            self.dp.set_grad_sync(chunk, enabled)

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    # ---- one optimizer step's worth of work ---------------------------------------------------------
    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn | None = None
    ) -> torch.Tensor:
        """Run every micro-batch of this replica's batch (any layout, pipeline included); return the
        global-batch mean loss on every rank. `loss_fn` replaces the model's loss for this call."""
        if loss_fn is not None:
            previous, self.loss_fn = self.loss_fn, loss_fn
            try:
                return self.forward_backward(inputs, targets)
            finally:
                self.loss_fn = previous
        self.train(True)
        inputs, targets = self.seq_shard(inputs), self.seq_shard(targets)
        micro_inputs, micro_targets = inputs.chunk(self.n_micro), targets.chunk(self.n_micro)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(micro_inputs, micro_targets)
        else:
            model = self.chunks[0]
            loss = torch.zeros((), device=inputs.device)
            for i, (x, y) in enumerate(zip(micro_inputs, micro_targets, strict=True)):
                self.set_grad_sync(0, i == self.n_micro - 1)
                with self.autocast():
                    micro_loss = self.loss_fn(model(x), y) / self.n_micro
                micro_loss.backward()
                loss += micro_loss.detach()
        if self.dp is not None:
            self.dp.finish_grad_sync()
        return self.replica_mean(loss)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward-only loss of this replica's batch, averaged over replicas."""
        self.train(False)
        inputs, targets = self.seq_shard(inputs), self.seq_shard(targets)
        if self.pipeline is not None:
            loss = self.pipeline.eval_step(inputs.chunk(self.n_micro), targets.chunk(self.n_micro))
        else:
            with self.autocast():
                loss = self.loss_fn(self.chunks[0](inputs), targets).float()
        return self.replica_mean(loss)

    def replica_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of a per-replica scalar over data-parallel replicas (from the last stage under pp), and
        over cp ranks: each holds the mean over as many tokens, so their mean is the global-token mean."""
        loss = loss.detach().float().clone()
        if self.pipeline is not None:
            self.pipeline.broadcast_from_last_stage(loss)
        replicas = self.mesh.size("dp") * self.mesh.size("cp")
        if replicas > 1:
            with comm("all_reduce"):
                dist.all_reduce(loss, group=self.mesh.group("dp_cp"))
            loss /= replicas
        return loss

    # ---- a loop of one's own: forward, backward, no_sync, step ------------------------------------------
    def __call__(self, *args: object, **kwargs: object) -> object:
        """The model's forward on this rank (not under pipeline parallelism: use `forward_backward`)."""
        if self.pipeline is not None:
            raise RuntimeError("under pipeline parallelism call forward_backward(inputs, targets, loss_fn)")
        with self.autocast():
            return self.chunks[0](*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), then (outside `no_sync`) wait for the overlapped gradient reduction to finish."""
        loss.backward()
        if self.dp is not None and all(self.dp.grad_sync):
            self.dp.finish_grad_sync()

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
        """This cp rank's load-balanced chunks of every row (meshlm.parallel.context_parallel), which
        `forward_backward` and `eval_loss` take themselves; without context parallel the rows unchanged."""
        if self.mesh.size("cp") == 1:
            return batch
        from meshlm.parallel.context_parallel import shard_sequence

        return shard_sequence(batch, self.mesh.size("cp"), self.mesh.rank("cp"))

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel replica's rows of a global batch (the same on every tp / pp / cp rank: a loop
        of one's own calling the model directly under cp passes it `seq_shard` of them)."""
        dp, rank = self.mesh.size("dp"), self.mesh.rank("dp")
        if batch.shape[0] % dp:
            raise ValueError(f"global batch of {batch.shape[0]} rows does not split over dp={dp}")
        rows = batch.shape[0] // dp
        return batch[rank * rows : (rank + 1) * rows]

    # ---- optimizer interface ------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model parameters this rank holds (tp shards, its pipeline stages), under the model's names."""
        for chunk in self.chunks:
            yield from chunk.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        """What an optimizer must step: the parameters, or under ZeRO this rank's fp32 master shards."""
        return [p for group in self.optimizer_param_groups(0.0) for p in group["params"]]

    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        """Matrices decay, vectors (norm weights, biases) do not; under ZeRO the groups hold flat shards."""
        if self.dp is not None:
            return self.dp.optimizer_param_groups(weight_decay)
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the true global norm: every gradient element counted once over the whole world.
        Stays on the device, no host sync: a non-finite norm leaves the gradients unscaled (coefficient 1)."""
        skip_tp_copy = self.mesh.rank("tp") > 0
        device = next(self.chunks[0].parameters()).device
        if self.dp is not None:
            sq = self.dp.grad_sq_sum(skip=lambda p: skip_tp_copy and is_tp_replicated(p)).to(device)
        else:
            grads = [
                p.grad.detach()
                for _, p in self.named_parameters()
                if p.grad is not None and not (skip_tp_copy and is_tp_replicated(p))
            ]
            sq = squared_norm_sum(grads, device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with comm("all_reduce"):
                dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if max_norm > 0:
            coef = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
            if self.dp is not None:
                self.dp.scale_grads_(coef)
            else:
                grads = [p.grad.detach() for _, p in self.named_parameters() if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm

    def after_optimizer_step(self) -> None:
        if self.dp is not None:
            self.dp.after_optimizer_step()

    def zero_grad(self) -> None:
        if self.dp is not None:
            self.dp.zero_grad()
        else:
            for _, p in self.named_parameters():
                p.grad = None

    # ---- state for checkpoints ----------------------------------------------------------------------
    def local_shards(
        self, optimizer: torch.optim.Optimizer | None = None, writer: bool = False
    ) -> dict[str, list[ShardedTensor]]:
        """Pieces of fp32 state this rank holds, as flat views into live storage: 'model' (ZeRO masters or the
        parameters) and, given the optimizer, each of its per-element states (optimizer_state_keys). A
        piece's shape and offset are within the parameter as this rank holds it (its tp slice). All of them by
        default (what a load fills); with `writer`, only this rank's share of what is replicated, so that
        over all ranks every element is written once and the writing is spread over the replicas (dp
        copies, tp-replicated norms)."""
        if self.dp is not None:
            out = self.dp.sharded_state_dict(optimizer, replicas="spread" if writer else "all")
        else:
            keys = ["model"] + (optimizer_state_keys(optimizer) if optimizer is not None else [])
            out = {key: [] for key in keys}
            for name, p in self.named_parameters():
                out["model"].append(ShardedTensor(name, p.shape, 0, p.detach().view(-1)))
                for key in keys[1:]:
                    out[key].append(ShardedTensor(name, p.shape, 0, optimizer.state[p][key].view(-1)))
        if writer and self.mesh.rank("tp") > 0:
            params = dict(self.named_parameters())
            out = {key: [s for s in pieces if not is_tp_replicated(params[s.name])] for key, pieces in out.items()}
        return out

    def after_load(self) -> None:
        """Refresh the working weights from freshly loaded fp32 masters (ZeRO-1/2 all-gather them; ZeRO-3
        gathers from the masters before each use anyway)."""
        self.after_optimizer_step()

    # ---- gathering the whole model ------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights under the model's names, on every rank (tests, export, generation)."""
        if self.dp is not None:
            state = self.dp.unsharded_state_dict()
        else:
            state = {}
            for chunk in self.chunks:
                state.update({k: v.detach().float().cpu().clone() for k, v in chunk.state_dict().items()})
        if self.mesh.size("tp") > 1:
            from meshlm.parallel.tensor_parallel import unshard_state_dict

            params = {n: p for c in self.chunks for n, p in c.named_parameters(remove_duplicate=False)}
            state = unshard_state_dict(state, params, self.mesh.group("tp"))
        if self.pipeline is not None:
            parts: list[dict[str, torch.Tensor] | None] = [None] * self.mesh.size("pp")
            dist.all_gather_object(parts, state, group=self.mesh.group("pp"))
            state = {k: v for part in parts for k, v in part.items()}
        return state
