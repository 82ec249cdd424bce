"""Checkpoints: atomic, checksummed folders in the run directory, loaded without unpickling code."""

from meshlm.checkpoint.store import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state",
    "save_checkpoint",
    "verify_checkpoint",
]
