"""What a checkpoint holds for a ParallelModel: its fp32 weights and AdamW moments as global tensors.

Keys are layout-free (`model/<HF name>`, `optim/exp_avg/<HF name>`, `optim/exp_avg_sq/<HF name>`, each of the
full model's shape), so any layout can load what any other layout saved. This rank contributes the boxes it
holds: ZeRO flat pieces cut into row boxes (shards.flat_range_boxes), moved by its tensor-parallel offset.
"""

from __future__ import annotations

import functools
import math

import torch

from meshlm.checkpoint.shards import Chunks, flat_range_boxes
from meshlm.model import Transformer
from meshlm.model.config import ModelConfig
from meshlm.parallel.engine import ParallelModel

MOMENTS = ("exp_avg", "exp_avg_sq")


@functools.lru_cache(maxsize=4)
def global_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter's full shape, from a model built on the meta device (no memory). Cached: building
    even a meta model takes half a second at 405B, and every save would otherwise pay it while training waits."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: p.shape for name, p in model.named_parameters()}


def key_of(kind: str, name: str) -> str:
    return f"model/{name}" if kind == "model" else f"optim/{kind}/{name}"


def training_entries(
    model: ParallelModel, optimizer: torch.optim.Optimizer | None = None, writer: bool = False
) -> dict[str, Chunks]:
    """This rank's boxes of every global tensor, as views of the live weights (and optimizer moments): all it
    holds (to load into), or with `writer` its share of them (to save: every box is written by one rank)."""
    shapes = global_shapes(model.cfg)
    params = dict(model.named_parameters())
    entries: dict[str, Chunks] = {}
    for kind, pieces in model.local_shards(optimizer, writer).items():
        for piece in pieces:
            tp_dim, tp_start = getattr(params[piece.name], "_meshlm_tp_slice", (None, 0))
            entry = entries.setdefault(key_of(kind, piece.name), Chunks(shapes[piece.name], [], []))
            start = 0
            for offsets, sizes in flat_range_boxes(
                piece.global_shape, piece.offset, piece.offset + piece.local.numel()
            ):
                n = math.prod(sizes)
                entry.views.append(piece.local[start : start + n].view(sizes))
                start += n
                if tp_dim is not None:
                    offsets = tuple(o + tp_start if d == tp_dim else o for d, o in enumerate(offsets))
                entry.offsets.append(offsets)
    return entries


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zero moments, step 0) ahead of its first step, so a checkpoint can fill it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for moment in MOMENTS:
                    state[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates AdamW has applied (the same for every parameter; skipped steps do not count)."""
    for state in optimizer.state.values():
        return int(state["step"])
    return 0


def set_optimizer_steps(optimizer: torch.optim.Optimizer, steps: int) -> None:
    for state in optimizer.state.values():
        state["step"].fill_(steps)
