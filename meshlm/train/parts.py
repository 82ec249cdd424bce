"""What a user may hand meshlm's trainer instead of its built-ins: a model, a loss, data, an optimizer factory
and callbacks (Composer-style). Anything left out is meshlm's own: the Llama of `cfg.model`, token
cross-entropy, the tokenized corpus of `cfg.data` and AdamW from `cfg.train`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshlm.parallel.parallel_plan import ParallelPlan

if TYPE_CHECKING:
    from meshlm.train.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class BatchSource(Protocol):
    """Global batches in a fixed order, resumable: `step` batches consumed so far, `next_batch` this dp rank's
    rows of the next one, and a JSON-serialisable state (saved in every checkpoint: the data position)."""

    step: int

    def next_batch(self, dp_rank: int, dp: int) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class IterableBatches:
    """A BatchSource over any re-iterable of global (inputs, targets) batches — a list, a DataLoader without
    shuffling, a generator function. Resuming at step k iterates afresh and skips k batches; the iterable is
    cycled if the run is longer than it."""

    def __init__(self, batches: Iterable[Batch] | Callable[[], Iterable[Batch]]) -> None:
        self.batches = batches
        self.step = 0
        self._iter: Iterator[Batch] | None = None

    def _fresh(self) -> Iterator[Batch]:
        return iter(self.batches() if callable(self.batches) else self.batches)

    def next_batch(self, dp_rank: int, dp: int) -> Batch:
        if self._iter is None:
            self._iter = self._fresh()
            for _ in range(self.step):
                self._next()
        x, y = self._next()
        self.step += 1
        if x.shape[0] % dp:
            raise ValueError(f"a global batch of {x.shape[0]} rows does not split over dp={dp}")
        rows = slice(dp_rank * x.shape[0] // dp, (dp_rank + 1) * x.shape[0] // dp)
        return x[rows], y[rows]

    def _next(self) -> Batch:
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = self._fresh()
            return next(self._iter)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self._iter = int(state["step"]), None


class Callback:
    """Hooks into meshlm's loop; override any of them. Each runs on every rank after the event."""

    def on_step_end(self, trainer: Trainer, step: int, loss: float, metrics: dict[str, float]) -> None:
        """After optimizer step `step` (1-based), with its global loss and this rank's metrics."""

    def on_eval(self, trainer: Trainer, step: int, loss: float) -> None:
        """After an evaluation at `step`, with the validation loss."""

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        """After a checkpoint of `step` was started (async saves finish in the background)."""


@dataclass
class TrainParts:
    """The user's pieces for `meshlm.fit`; None means meshlm's built-in one.

    model:      an nn.Module, or a factory called after seeding with `train.seed` (the same weights on every
                rank; a module passed directly must already be built that way)
    loss_fn:    (model output, targets) -> per-token losses shaped like targets (reduction="none"); meshlm
                averages them over the kept tokens (targets != -100) of the global batch
    gather_logits: under tp, give the model's full logits to `loss_fn` (default: a loss of one's own under
                tp is refused, as the logits are vocab-sharded; meshlm's own loss keeps them sharded)
    data:       a BatchSource, or an iterable of global (inputs, targets) batches
    eval_data:  an iterable (or a factory of one) of global validation batches
    optimizer:  param groups -> torch.optim.Optimizer (e.g. `lambda groups: torch.optim.SGD(groups, lr=0.1)`)
    plan:       the ParallelPlan for the model (default: registered for its class, else DP/ZeRO only)
    """

    model: nn.Module | Callable[[], nn.Module] | None = None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    data: BatchSource | Iterable[Batch] | None = None
    eval_data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None
    optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None
    callbacks: list[Callback] = field(default_factory=list)
    plan: ParallelPlan | None = None
    gather_logits: bool = False

    def build_model(self, seed: int) -> nn.Module | None:
        if self.model is None or isinstance(self.model, nn.Module):
            return self.model
        torch.manual_seed(seed)
        return self.model()

    def batch_source(self) -> BatchSource | None:
        if self.data is None or isinstance(self.data, BatchSource):
            return self.data
        return IterableBatches(self.data)

    def eval_batches(self) -> Iterable[Batch]:
        return self.eval_data() if callable(self.eval_data) else self.eval_data
