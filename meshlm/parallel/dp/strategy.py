"""Data parallel / ZeRO's Strategy (imports no torch). Its size rule is the batch split over the replicas
(meshlm.parallel.contract.check_batch_split, which every layout's micro-batch count needs), its plan rules
meshlm.parallel.dp.rules (ZeRO-3 units), its mechanics meshlm.parallel.dp.data_parallel (with dp.zero and
dp.gradients, the one owner of the gradients and optimizer tensors), its run-time hooks meshlm.parallel.dp.hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


class DataParallelism:
    """meshlm.parallel.dp.data_parallel: replicas average their gradients (overlapped, bucketed); ZeRO 1-3 shards
    optimizer state, gradients and weights. Always applied: at one replica without ZeRO it only materialises a
    meta-built model on the device. Its Applied carries the gradients' owner (`grads`) and, where replicas
    reduce or ZeRO shards, the DataParallel object (`parts["dp"]`)."""

    dim = "dp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return True

    def check_layout(self, spec: LayoutSpec) -> None:
        spec.n_micro  # noqa: B018 — the property raises the one-line LayoutError
        options = spec.options  # surely fp32 working weights: zero 0 or 'fp32' ('auto' waits for the device: apply)
        check_grad_accum_dtype(options, "fp32" if options.zero == 0 or options.zero_param_dtype == "fp32" else "bf16")

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.dp.rules import check_zero3_units

        if options.zero == 3:
            check_zero3_units(model, plan)

    def apply(self, build: Build) -> Applied:
        import torch

        from meshlm.parallel.distributed import AUTOCAST_DTYPES
        from meshlm.parallel.dp.data_parallel import DataParallel, replica_group
        from meshlm.parallel.dp.gradients import LocalGradients
        from meshlm.parallel.dp.hooks import DataParallelHooks

        mesh, options, chunks = build.mesh, build.options, list(build.chunks)
        packed = mesh.size("replicas") > 1 or options.zero > 0  # data parallel / ZeRO lays the parameters out
        if build.meta_init is not None:
            build.meta_init.replace_params(build.model, chunks, packed, packs_frozen=options.zero == 3)
        dp = None
        if packed:
            param_dtype = zero_param_dtype(options, build.device_type, AUTOCAST_DTYPES.get(options.autocast_dtype))
            check_grad_accum_dtype(options, "bf16" if param_dtype == torch.bfloat16 else "fp32")
            dp = DataParallel(
                chunks,
                replica_group(mesh),
                zero=options.zero,
                bucket_mb=options.bucket_mb,
                shard_group_size=options.zero_shard_size,
                param_dtype=param_dtype,
                reduce_dtype=torch.bfloat16 if options.zero_reduce_dtype == "bf16" else torch.float32,
                grad_accum_dtype=torch.bfloat16 if options.grad_accum_dtype == "bf16" else torch.float32,
                plan=build.plan,
                source=build.meta_init,
                grad_groups={name: mesh.group(name) for name in build.placements.grad_groups()},
                placements=build.placements,
            )
        if build.meta_init is not None:
            build.meta_init.check_done()
        return DataParallelHooks(dp or LocalGradients(chunks), mesh, dp)


def zero_param_dtype(parallel: ParallelOptions, device_type: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The working weights' dtype over fp32 master shards: `parallel.zero_param_dtype`, where 'auto' is bf16
    under ZeRO ≥ 1 with bf16 autocast on CUDA (FSDP2's usual MixedPrecisionPolicy: the matmuls run in bf16
    anyway, so gathers of bf16 weights halve the traffic and memory), else fp32 (zero 0 steps the fp32
    weights themselves)."""
    import torch

    choice = parallel.zero_param_dtype
    if choice == "auto":
        cuda_bf16 = device_type == "cuda" and autocast_dtype == torch.bfloat16
        choice = "bf16" if parallel.zero >= 1 and cuda_bf16 else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def check_grad_accum_dtype(parallel: ParallelOptions, working: str) -> None:
    """`parallel.grad_accum_dtype = 'bf16'` keeps the gradient buffer in the bf16 working weights' dtype;
    over fp32 working weights (`working`: zero 0, zero_param_dtype 'fp32', or 'auto' off CUDA with bf16
    autocast) it has no meaning: a one-line LayoutError."""
    if parallel.grad_accum_dtype == "bf16" and working != "bf16":
        raise LayoutError(
            "parallel.grad_accum_dtype = 'bf16' needs bf16 working weights (parallel.zero >= 1 with "
            "parallel.zero_param_dtype = 'bf16', or 'auto' under bf16 autocast on CUDA), here fp32 "
            f"(parallel.zero = {parallel.zero}, parallel.zero_param_dtype = '{parallel.zero_param_dtype}'); "
            "use 'fp32'"
        )
