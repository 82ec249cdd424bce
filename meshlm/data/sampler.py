"""Deterministic batches: what global step k trains on depends only on (seed, k), never on the world size.

The token stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs plus the shifted target).
Each epoch visits every window once, in an order drawn from (seed, epoch). Global sample i is window
`perm[epoch](i % n_windows)` with epoch = i // n_windows, and step k holds samples [k*B, (k+1)*B). A rank
materialises only its own rows, and a resumed run continues the exact same sequence of batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def _count_windows(tokens: np.ndarray, seq_len: int) -> int:
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"the token split has {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}")
    return n


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


class GlobalBatchSampler:
    """Global batches of (inputs, targets), each (global_batch, seq_len) int64, plus a resumable position."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.n_windows = self._count_windows()
        self.step = 0
        self._perms: dict[int, np.ndarray] = {}  # the last two epochs: a batch may straddle a boundary

    def _count_windows(self) -> int:
        return _count_windows(self.tokens, self.seq_len)

    def _gather_windows(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given windows, one row each."""
        return _gather(self.tokens, windows * self.seq_len, self.seq_len)

    def _permutation(self, epoch: int) -> np.ndarray:
        """Window order of one epoch, from PCG64's raw stream (stable across numpy versions) via a stable sort."""
        if epoch not in self._perms:
            if len(self._perms) == 2:
                del self._perms[min(self._perms)]
            bits = np.random.PCG64(np.random.SeedSequence([self.seed % 2**64, epoch]))
            self._perms[epoch] = np.argsort(bits.random_raw(self.n_windows), kind="stable")
        return self._perms[epoch]

    def _rows(self, step: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        samples = step * self.global_batch + np.arange(first, first + count)
        epochs, positions = np.divmod(samples, self.n_windows)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._permutation(int(epoch))[positions[mask]]
        return self._gather_windows(windows)

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(step, 0, self.global_batch)

    def local_batch_at(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank*B/world, (rank+1)*B/world) of global step `step`, without building the other rows."""
        if self.global_batch % world:
            raise ValueError(
                f"train.global_batch ({self.global_batch}) must be divisible by the data-parallel size ({world})"
            )
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a data-parallel group of size {world}")
        local = self.global_batch // world
        return self._rows(step, rank * local, local)

    def rows_at(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples [first, first + count) of the stream, whatever the step (fault-tolerant replica groups
        shrink the batch with the live groups, so their position is a sample count: meshlm.train.replicas)."""
        return self._rows(0, first, count)

    def next_batch(self, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the current step, then advance: the position is part of the training state."""
        batch = self.local_batch_at(self.step, rank, world)
        self.step += 1
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "n_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step; refuse if the saved run sampled a different stream."""
        for name in ("seed", "seq_len", "global_batch", "n_tokens"):
            if state[name] != self.state_dict()[name]:
                raise ValueError(
                    f"sampler state mismatch: checkpoint has {name}={state[name]}, "
                    f"this run has {name}={self.state_dict()[name]}; resume with the same data and batch settings"
                )
        self.step = int(state["step"])


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch: int, n_batches: int, rank: int = 0, world: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same `n_batches` batches on every call: windows evenly spread over the split (repeating if short).

    With world > 1, each rank yields its rows [rank*batch/world, (rank+1)*batch/world) of every batch.
    """
    for windows in eval_windows(_count_windows(tokens, seq_len), batch, n_batches, rank, world):
        yield _gather(tokens, windows * seq_len, seq_len)


def eval_windows(n_windows: int, batch: int, n_batches: int, rank: int = 0, world: int = 1) -> Iterator[np.ndarray]:
    """The window indices of `eval_batches`: `n_batches` batches evenly spread over `n_windows` windows, this
    rank's rows of each."""
    if batch % world:
        raise ValueError(f"eval batch ({batch}) must be divisible by the data-parallel size ({world})")
    windows = np.linspace(0, n_windows - 1, n_batches * batch).round().astype(np.int64).reshape(n_batches, batch)
    local = batch // world
    for row in windows:
        yield row[rank * local : (rank + 1) * local]
