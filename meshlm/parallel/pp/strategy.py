"""Pipeline parallel's size rules and its Strategy (imports no torch). Its plan rules are meshlm.parallel.pp.rules,
its mechanics meshlm.parallel.pp.pipeline (the stage split, tied stages, the schedule's executor, with
pp.schedules and pp.stages), its run-time hooks meshlm.parallel.pp.hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.parallel.contract import Applied, Build, LayoutSpec
from meshlm.parallel.mesh import Layout, LayoutError
from meshlm.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch import nn

    from meshlm.parallel.parallel_plan import ParallelPlan


def check_pipeline_chunks(layout: Layout, n_layers: int, virtual_stages: int = 1, schedule: str = "1f1b") -> None:
    """Each pipeline chunk gets a layer; virtual stages need the interleaved schedule."""
    chunks = layout.pp * virtual_stages
    if chunks > n_layers:
        raise LayoutError(f"pp×virtual_stages = {chunks} exceeds model.n_layers ({n_layers}); each chunk needs a layer")
    if virtual_stages > 1 and schedule != "interleaved":
        raise LayoutError(f"parallel.virtual_stages={virtual_stages} needs parallel.schedule = 'interleaved'")


def check_pipeline_schedule(layout: Layout, n_micro: int, schedule: str = "1f1b") -> None:
    """Enough micro-batches per replica for the schedule."""
    pp = layout.pp
    if pp > 1 and schedule in ("1f1b", "interleaved", "zb1") and n_micro < pp:
        raise LayoutError(
            f"schedule {schedule} needs at least pp={pp} micro-batches per replica, got {n_micro} "
            f"(set train.micro_batch so that the per-replica batch splits into at least {pp})"
        )
    if schedule == "interleaved" and pp > 1 and n_micro % pp:
        raise LayoutError(f"interleaved schedule needs micro-batches per replica ({n_micro}) divisible by pp={pp}")


class PipelineParallel:
    """meshlm.parallel.pp.pipeline: this rank keeps its stage(s) of the plan's layers; a schedule runs them.
    Its Applied carries the stages (`chunks`: what later strategies and the engine run) and the schedule
    (`parts["pipeline"]`); it calls back into the step only through `build.step`."""

    dim = "pp"

    def enabled(self, layout: Layout, options: ParallelOptions) -> bool:
        return layout.pp > 1

    def check_layout(self, spec: LayoutSpec) -> None:
        n_layers = spec.n_layers or (spec.model.n_layers if spec.model is not None else 1)
        check_pipeline_chunks(spec.layout, n_layers, spec.options.virtual_stages, spec.options.schedule)
        check_pipeline_schedule(spec.layout, spec.n_micro, spec.options.schedule)

    def check(self, model: nn.Module, plan: ParallelPlan, layout: Layout, options: ParallelOptions) -> None:
        from meshlm.parallel.pp.pipeline import check_stage_forwards, hidden_size
        from meshlm.parallel.pp.rules import check_pipeline_split

        check_pipeline_split(model, plan, layout.pp)
        hidden_size(model, plan.pipeline)
        check_stage_forwards(model, plan, layout.pp * options.virtual_stages)

    def apply(self, build: Build) -> Applied:
        from meshlm.parallel.pp.hooks import PipelineHooks
        from meshlm.parallel.pp.pipeline import PipelineSchedule, TiedStages, hidden_size, split_model

        mesh, options, step = build.mesh, build.options, build.step
        layout = mesh.layout
        chunks = split_model(
            build.model,
            mesh.rank("pp"),
            layout.pp,
            options.virtual_stages,
            plan=build.plan,
            placements=build.placements,
        )
        schedule = PipelineSchedule(
            chunks,
            mesh.group("pp"),
            schedule=options.schedule,
            n_micro=build.options.micro_batches,
            loss_fn=step.loss,
            autocast=step.autocast,
            set_grad_sync=step.set_grad_sync,
            seq_shards=layout.tp if options.sequence_parallel else 1,
            hidden_size=hidden_size(build.model, build.plan.pipeline),
        )
        tied = TiedStages.build(build.model, chunks, build.plan.pipeline, mesh, build.placements)
        if tied is not None and tied.replica:  # the first stage counts and writes a tied weight
            for p in tied.params:
                build.placements.record(p, counted=False)
        return PipelineHooks(schedule, tied, mesh, chunks)
