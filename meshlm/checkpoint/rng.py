"""The random streams a checkpoint carries, so a resumed run draws what an uninterrupted one draws (dropout).

Every rank saves its torch CPU generator as `rng/cpu/<rank>` and, when it has used CUDA, its device's
generator as `rng/cuda/<rank>`. The rule on load:

- the same world size as the checkpoint's: rank r restores rank r's streams (any layout: the streams
  belong to ranks, not to parameters, so they are never resharded);
- another world size: no rank's saved stream is the one it would have had, so every rank's generators are
  seeded from `seed_of(train.seed, step)` instead, the same on every rank as a fresh start's are. The run is
  reproducible (two resumes of one checkpoint at one world size draw the same numbers) but its dropout masks
  differ from an uninterrupted run's; the trainer says so in one line.

A fresh start seeds every rank's generators from `seed_of(train.seed, 0)` right before step 1, so the streams of
step 1 on never depend on what start-up drew (a measured matmul peak draws its operands once per process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_STRIDE = 1_000_003  # a prime: the seeds of (seed, step) pairs of one run never repeat


def seed_of(seed: int, step: int) -> int:
    """The seed of every rank's generators for a run (`train.seed`) starting step `step` + 1 without saved
    streams. Never `seed` itself: the initial weights were drawn from `torch.manual_seed(seed)`, and dropout
    masks drawn from the same numbers would be correlated with them."""
    return (seed + (step + 1) * STEP_STRIDE) % 2**63


def seed_streams(seed: int) -> None:
    """Seed this process's CPU generator and every CUDA device's."""
    torch.manual_seed(seed)


def cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class Streams:
    """One rank's generator states: its CPU generator's and its current CUDA device's (None if not saved)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def current(cls) -> Streams:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state() if cuda_in_use() else None)

    def entries(self, rank: int) -> dict[str, torch.Tensor]:
        """The checkpoint entries of rank `rank`'s streams."""
        found = {f"rng/cpu/{rank}": self.cpu}
        if self.cuda is not None:
            found[f"rng/cuda/{rank}"] = self.cuda
        return found

    def restore(self, cuda_seed: int | None = None) -> None:
        """Set this process's generators; a CUDA device in use without a saved state (the checkpoint was
        written on CPU) is seeded from `cuda_seed` if given."""
        torch.set_rng_state(self.cpu)
        if cuda_in_use() and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        elif cuda_in_use() and cuda_seed is not None:
            torch.cuda.manual_seed(cuda_seed)


def saved_world_size(keys: object) -> int:
    """How many ranks saved their streams in a checkpoint, from its metadata's keys."""
    return sum(1 for key in keys if str(key).startswith("rng/cpu/"))


def start_streams(streams: Streams | None, seed: int, step: int) -> None:
    """Set the generators a run starts step `step` + 1 with: a resume's saved streams, else (a fresh start,
    or a resume at another world size) every rank seeded from `seed_of(seed, step)`."""
    if streams is not None:
        streams.restore(cuda_seed=seed_of(seed, step))
    else:
        seed_streams(seed_of(seed, step))


def reseeded_line(saved_world: object, world: int, step: int) -> str:
    return (
        f"random streams: the checkpoint was saved by {saved_world} ranks, this run has {world}; every rank's "
        f"generators are seeded from train.seed and step {step} (reproducible, but dropout and other random "
        "draws differ from an uninterrupted run's)"
    )
