"""meshlm pipeline schedules side by side with torch.distributed.pipelining on the same model, split and batch.

For each schedule (GPipe, 1F1B, interleaved 1F1B with v=2, zero-bubble ZB-H1 "zb1") and number of micro-batches
m, both systems run
forward+backward steps over the same chunks (`split_model`, wrapped in `PipelineStage` for torch); systems
take turns over `--rounds` rounds and the best round counts, which keeps other load on a shared machine from
favouring whoever ran at a quiet moment. Prints a markdown table: tokens/s of each system and their ratio,
meshlm's measured bubble (share of the step a rank waits for messages, mean over ranks) beside the
theoretical one, CPU time per step (max over ranks: on a shared machine it separates a system's own cost from
waiting for a core), and activation memory: the peak bytes autograd holds saved for backward (max over ranks,
both systems) and meshlm's peak count of in-flight micro-batches (forward done, backward not yet).
torch has no one-stage-per-rank zero-bubble schedule, so zb1 runs beside torch's 1F1B, the schedule it improves.
meshlm's W pass is autograd over the stage's weights only, which walks the graph again (the B pass skipped the
weight-gradient products but not the activation gradients): on top of the bubble it removes, it adds work.

    .venv/bin/python benchmarks/pipeline.py            # tiny preset, pp=2, ~2-3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model import Transformer, cross_entropy_loss, preset
from meshlm.parallel.pp.pipeline import PipelineSchedule, split_model
from meshlm.parallel.pp.schedules import theoretical_bubble
from meshlm.testing import run_distributed

Step = Callable[[torch.Tensor, torch.Tensor], float]


class ActivationMeter:
    """Peak bytes of the tensors autograd saves for backward, parameters excluded and shared storage counted once.

    Allocator-independent, so it isolates what a schedule changes: how many micro-batches' activations live.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        return _Saved(self, tensor)


class _Saved:
    """Holds one saved tensor; its lifetime is the graph's, so __del__ marks the storage as freed."""

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        self.meter, self.tensor = meter, tensor
        storage = tensor.untyped_storage()
        self.key = None if storage.data_ptr() in meter.param_storages else storage.data_ptr()
        if self.key is not None:
            meter.refs[self.key] = meter.refs.get(self.key, 0) + 1
            if meter.refs[self.key] == 1:
                meter.live += storage.nbytes()
                meter.peak = max(meter.peak, meter.live)
        self.nbytes = storage.nbytes()

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.refs[self.key] -= 1
            if self.meter.refs[self.key] == 0:
                del self.meter.refs[self.key]
                self.meter.live -= self.nbytes


def meshlm_step(chunks: list[nn.Module], group: dist.ProcessGroup, schedule: str, m: int) -> tuple[Step, Callable]:
    pipe = PipelineSchedule(chunks, group, schedule=schedule, n_micro=m)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return pipe.train_step(x.chunk(m), y.chunk(m)).item()

    return step, lambda: pipe.stats


def torch_step(chunks: list[nn.Module], group: dist.ProcessGroup, schedule: str, m: int) -> Step:
    """The same chunks as torch PipelineStages under the matching torch schedule (grads scaled by 1/m, as ours)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    n_stages = pp * len(chunks)
    cpu = torch.device("cpu")
    stages = [PipelineStage(chunk, c * pp + rank, n_stages, cpu, group=group) for c, chunk in enumerate(chunks)]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=cross_entropy_loss)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb1": Schedule1F1B}[schedule](
            stages[0], m, loss_fn=cross_entropy_loss
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        return torch.stack(losses).mean().item() if losses else 0.0

    return step


def bench_all(
    preset_name: str, seq: int, micro_batch: int, micros: list[int], schedules: list[str], steps: int, rounds: int
) -> dict[tuple[str, int, str], dict]:
    """Every (schedule, m, system) in turn, `rounds` times; keep each one's fastest round."""
    group = dist.group.WORLD
    pp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(preset(preset_name))
    chunks = {v: split_model(model, rank, pp, v) for v in {2 if s == "interleaved" else 1 for s in schedules}}
    params = list(model.parameters())

    def zero_grad() -> None:
        for p in params:
            p.grad = None

    configs = [(s, m) for s in schedules for m in micros]
    systems: dict[tuple[str, int, str], Step] = {}
    stats_of = {}
    result: dict[tuple[str, int, str], dict] = {}
    for s, m in configs:
        v_chunks = chunks[2 if s == "interleaved" else 1]
        systems[(s, m, "meshlm")], stats_of[(s, m)] = meshlm_step(v_chunks, group, s, m)
        systems[(s, m, "torch")] = torch_step(v_chunks, group, s, m)
    g = torch.Generator().manual_seed(0)
    batches = {m: torch.randint(0, model.cfg.vocab_size, (m * micro_batch, seq + 1), generator=g) for m in micros}

    for key, step in systems.items():  # warm-up (torch infers shapes on its first step) and activation memory
        tokens = batches[key[1]]
        meter = ActivationMeter(params)
        with meter.hooks():
            loss = step(tokens[:, :-1], tokens[:, 1:])
        zero_grad()
        in_flight = stats_of[key[:2]]().peak_in_flight if key[2] == "meshlm" else 0
        peaks = torch.tensor([float(meter.peak), float(in_flight), abs(loss)])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the loss is only known (non-zero) on the last stage
        result[key] = {"act_bytes": peaks[0].item(), "in_flight": int(peaks[1]), "loss": peaks[2].item()}
        result[key]["step_s"] = float("inf")

    for _ in range(rounds):
        for key, step in systems.items():
            tokens = batches[key[1]]
            dist.barrier()
            start, cpu_start, wait = time.perf_counter(), time.process_time(), 0.0
            for _ in range(steps):
                step(tokens[:, :-1], tokens[:, 1:])
                zero_grad()
                if key[2] == "meshlm":
                    stats = stats_of[key[:2]]()
                    wait += stats.wait_s / stats.step_s
            elapsed = torch.tensor([time.perf_counter() - start, wait / steps])
            dist.all_reduce(elapsed)  # sum over ranks: [Σ time, Σ bubble]
            cpu = torch.tensor([time.process_time() - cpu_start])
            dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
            step_s = elapsed[0].item() / pp / steps
            if step_s < result[key]["step_s"]:
                result[key].update(step_s=step_s, bubble=elapsed[1].item() / pp, cpu_s=cpu.item() / steps)
    for key in result:
        result[key]["tokens_per_s"] = key[1] * micro_batch * seq / result[key]["step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--micros", default="2,4,8", help="numbers of micro-batches per step")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb1")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    micros = [int(m) for m in args.micros.split(",")]
    schedules = args.schedules.split(",")

    start = time.perf_counter()
    shape = (args.preset, args.seq, args.micro_batch, micros, schedules, args.steps, args.rounds)
    result = run_distributed(bench_all, args.pp, *shape, timeout=3600)[0]

    print(
        f"preset {args.preset}, pp={args.pp}, micro-batch {args.micro_batch}×{args.seq} tokens, gloo on CPU, "
        f"best of {args.rounds} rounds × {args.steps} steps ({time.perf_counter() - start:.0f} s)\n"
    )
    print(
        "| schedule | m | meshlm tokens/s | torch tokens/s | meshlm / torch | bubble measured | bubble theory "
        "| CPU ms/step meshlm | CPU ms/step torch | in-flight micro-batches (max rank) "
        "| activations MiB meshlm | activations MiB torch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    speed, cpu = [], []
    for s in schedules:
        for m in micros:
            ours, theirs = result[(s, m, "meshlm")], result[(s, m, "torch")]
            speed.append(ours["tokens_per_s"] / theirs["tokens_per_s"])
            cpu.append(theirs["cpu_s"] / ours["cpu_s"])
            assert abs(ours["loss"] - theirs["loss"]) < 1e-4 * abs(theirs["loss"]), (s, m, ours["loss"], theirs["loss"])
            v = 2 if s == "interleaved" else 1
            print(
                f"| {s}{' v=2' if v > 1 else ''} | {m} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | "
                f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} | {ours['bubble']:.2f} | "
                f"{theoretical_bubble(s, args.pp, m, v):.2f} | "
                f"{ours['cpu_s'] * 1e3:.0f} | {theirs['cpu_s'] * 1e3:.0f} | {ours['in_flight']} | "
                f"{ours['act_bytes'] / 2**20:.1f} | {theirs['act_bytes'] / 2**20:.1f} |"
            )
    print(
        f"\ngeometric mean meshlm / torch: tokens/s {math.prod(speed) ** (1 / len(speed)):.2f}, "
        f"tokens per CPU-second {math.prod(cpu) ** (1 / len(cpu)):.2f}"
    )


if __name__ == "__main__":
    main()
