"""meshlm: train Llama-style decoders with data, ZeRO, tensor and pipeline parallelism on one device mesh.

The public API (docs/api.md), importable from `meshlm` directly:

    init_mesh, parallelize, ParallelModel, Checkpoints, shutdown your model and your loop
    ParallelOptions, Loss, LoRAOptions                           parallelize's options, loss and adapters
    ParallelPlan, PipelineSplit, register_plan, plan_for,        per-family plan tables
    COLWISE, COLWISE_HEADS, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD, SEQUENCE_PARALLEL
    FusedColwise, InterleavedColwise                             styles for fused projections
    Normal, Constant                                             what a model's init_rule returns
    fit, Callback, BatchSource                                   meshlm's loop with your model, loss and data
    check                                                        a layout proven against one process (docs/check.md)
    StepObserver, StepGuard, Preemption, Watchdog                metrics and guards as calls
    Transformer, ModelConfig, preset                             the built-in Llama
    apply_lora, merge_lora                                       LoRA adapters by hand (docs/lora.md)
    InputError                                                   the base of every one-line bad-input error

Names load on first use, so `import meshlm` (and the CLI) stays fast.
"""

from __future__ import annotations

from meshlm.lazy import lazy_attributes

__version__ = "0.1.0"

_EXPORTS = {
    "init_mesh": "meshlm.api",
    "parallelize": "meshlm.parallel.engine",
    "shutdown": "meshlm.api",
    "Checkpoints": "meshlm.api",
    "ParallelModel": "meshlm.parallel.engine",
    "ParallelOptions": "meshlm.parallel.options",
    "Loss": "meshlm.parallel.options",
    "LoRAOptions": "meshlm.parallel.options",
    "ParallelPlan": "meshlm.parallel.parallel_plan",
    "PipelineSplit": "meshlm.parallel.parallel_plan",
    "register_plan": "meshlm.parallel.plan_registry",
    "plan_for": "meshlm.parallel.plan_registry",
    "PlanError": "meshlm.parallel.parallel_plan",
    "InputError": "meshlm.errors",
    "COLWISE": "meshlm.parallel.parallel_plan",
    "COLWISE_HEADS": "meshlm.parallel.parallel_plan",
    "ROWWISE": "meshlm.parallel.parallel_plan",
    "VOCAB_EMBEDDING": "meshlm.parallel.parallel_plan",
    "VOCAB_HEAD": "meshlm.parallel.parallel_plan",
    "SEQUENCE_PARALLEL": "meshlm.parallel.parallel_plan",
    "FusedColwise": "meshlm.parallel.parallel_plan",
    "InterleavedColwise": "meshlm.parallel.parallel_plan",
    "Normal": "meshlm.model.init",
    "Constant": "meshlm.model.init",
    "check": "meshlm.check",
    "fit": "meshlm.train.trainer",
    "Callback": "meshlm.train.trainer",
    "BatchSource": "meshlm.train.trainer",
    "StepObserver": "meshlm.observe",
    "StepGuard": "meshlm.train.guards",
    "Preemption": "meshlm.train.guards",
    "Watchdog": "meshlm.train.guards",
    "Transformer": "meshlm.model",
    "ModelConfig": "meshlm.model",
    "preset": "meshlm.model",
    "apply_lora": "meshlm.parallel.transforms.lora",
    "merge_lora": "meshlm.parallel.transforms.lora",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
