"""Checkpoints: sharded (DCP) and resharding, atomic and checksummed, loaded without unpickling code."""

from meshlm.checkpoint.checkpointer import Checkpointer
from meshlm.checkpoint.state import (
    init_optimizer_state,
    optimizer_steps,
    set_optimizer_steps,
    training_entries,
)
from meshlm.checkpoint.store import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_model_state,
    read_trainer_state,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "init_optimizer_state",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_model_state",
    "optimizer_steps",
    "read_trainer_state",
    "set_optimizer_steps",
    "training_entries",
    "verify_checkpoint",
]
