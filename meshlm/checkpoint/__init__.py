"""Checkpoints: sharded (DCP) and resharding, atomic and checksummed, loaded without unpickling code."""

from meshlm.checkpoint.checkpointer import CheckpointIO, finish_saves
from meshlm.checkpoint.state import (
    init_optimizer_state,
    load_step_counts,
    optimizer_steps,
    set_optimizer_steps,
    step_counts,
    training_entries,
)
from meshlm.checkpoint.store import (
    CheckpointError,
    CheckpointFolders,
    StorageError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_model_state,
    meshlm_checkpoint,
    read_trainer_state,
    storage_cause,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointFolders",
    "CheckpointIO",
    "StorageError",
    "finish_saves",
    "init_optimizer_state",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_model_state",
    "load_step_counts",
    "meshlm_checkpoint",
    "optimizer_steps",
    "read_trainer_state",
    "set_optimizer_steps",
    "step_counts",
    "storage_cause",
    "training_entries",
    "verify_checkpoint",
]
