"""The planner's predictions beside measurements of meshlm's real training step on this machine.

For each world size, one gloo group first runs `meshlm doctor`'s in-process measurement on the layout of that
world with the most mesh dims (matmul rate with every rank busy, memory bandwidth, fixed host time per layer
and per micro-batch, α–β of every collective on every dim of that layout), turns it into the planner's
Calibration, then trains every layout of that world size in turn. Per layout it measures, on every rank:
  * model-state bytes right after the optimizer step (params + grads + optimizer state; DataParallel's
    `memory_report` under dp/ZeRO, else the same count over the model's tensors, `meshlm.observe.memory`);
  * activation bytes: the peak of tensors autograd saves for backward during one step (`ActivationMeter`,
    parameters excluded), against the planner's activations + logits;
  * step time: the median of `--steps` optimizer steps after `--warmup`, each timed between barriers, the
    cases of a world size taking turns step by step.
The planner (`meshlm.plan.plan_strategy`, fp32, the measured calibration) predicts each for the same layout; memory
is the worst rank against the planner's fullest stage. Pass: memory within 10 %, step time within 25 %.
Layouts: one rank; dp=2 with ZeRO 0-3; tp=2; pp=2 (1F1B, GPipe); dp=2,tp=2; pp=2,dp=2; pp=2,tp=2; and
pp=2,dp=2,tp=2 on 8 ranks. Results and their reading: docs/benchmarks.md, "Planner vs measured".

    .venv/bin/python benchmarks/planner_check.py               # tiny preset: 2-2.5 minutes on 2 CPU cores
    .venv/bin/python benchmarks/planner_check.py --no-world8   # skip the 8-rank group
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import ParallelSection, TrainSection
from meshlm.model import ModelConfig, Transformer, preset
from meshlm.observe.calibration import calibration
from meshlm.observe.doctor import doctor
from meshlm.observe.memory import ActivationMeter, MemoryProbe
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import Layout, build_mesh, parse_layout
from meshlm.parallel.options import ParallelOptions
from meshlm.parallel.strategies import check_layout
from meshlm.plan import Candidate, Workload, hardware, plan_strategy
from meshlm.plan.memory import model_state_bytes, stage_params
from meshlm.plan.pipeline_split import rank_layers
from meshlm.testing import global_batch, run_distributed
from meshlm.train.optim import build_optimizer, train_step

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.25


@dataclass(frozen=True)
class Case:
    """One layout as meshlm's config spells it (`parallel.layout`, `parallel.zero`, `parallel.schedule`)."""

    layout: str
    zero: int = 0
    schedule: str = "1f1b"

    def sizes(self) -> dict[str, int]:
        given = dict(part.split("=") for part in self.layout.split(",") if part)
        return {dim: int(given.get(dim, 1)) for dim in ("pp", "dp", "tp")}

    def world(self) -> int:
        return self.sizes()["pp"] * self.sizes()["dp"] * self.sizes()["tp"]

    def name(self) -> str:
        return f"{self.layout or 'single'} zero={self.zero}" + (f" {self.schedule}" if "pp" in self.layout else "")


# Every strategy and their combinations on 1, 2 and 4 ranks (dp is always spelled out: parse_layout lets it
# take the rest of the world).
CASES = [
    Case("dp=1"),
    Case("dp=2", 0),
    Case("dp=2", 1),
    Case("dp=2", 2),
    Case("dp=2", 3),
    Case("dp=1,tp=2"),
    Case("pp=2,dp=1"),
    Case("pp=2,dp=1", schedule="gpipe"),
    Case("dp=2,tp=2", 1),
    Case("pp=2,dp=2", 0),
    Case("pp=2,dp=1,tp=2"),
]
WORLD8 = [Case("pp=2,dp=2,tp=2", 1)]


def _rank_model_states(pm: ParallelModel, opt: torch.optim.Optimizer) -> dict[str, int]:
    if pm.dp is not None:
        return pm.dp.memory_report(opt)
    probe = MemoryProbe(pm)  # without the optimizer: it would register its own step hook
    probe.optimizer = opt
    m = probe.measure()
    return {"params": m["mem_params_bytes"], "grads": m["mem_grads_bytes"], "optimizer": m["mem_optimizer_bytes"]}


def build_case(
    case: Case, model_cfg: ModelConfig, batch: int, micro_batch: int, seq_len: int
) -> tuple[Callable[[], None], dict]:
    """Build one layout on this group and run its first step: (a function that runs one more training step,
    this rank's model states and peak saved activations)."""
    par = ParallelSection(layout=case.layout, zero=case.zero, schedule=case.schedule)
    train = TrainSection(steps=2, global_batch=batch, micro_batch=micro_batch, lr=1e-3)
    lay = parse_layout(case.layout, dist.get_world_size())
    n_micro = check_layout(
        LayoutSpec(model_cfg, lay, batch, micro_batch, seq_len, ParallelOptions(schedule=case.schedule))
    )
    mesh = build_mesh(lay, "cpu")
    torch.manual_seed(0)
    pm = parallelize(Transformer(model_cfg), mesh, {**par.options().model_dump(), "micro_batches": n_micro})
    opt = build_optimizer(pm, train)
    rows = slice(mesh.rank("dp") * batch // lay.dp, (mesh.rank("dp") + 1) * batch // lay.dp)
    x, y = global_batch(0, batch, seq_len, model_cfg.vocab_size)
    x, y = x[rows], y[rows]
    # train_step drops gradients at its end: measure at the high-water mark, right after optimizer.step()
    states: dict[str, int] = {}
    opt.register_step_post_hook(lambda *_: states.update(_rank_model_states(pm, opt)))
    meter = ActivationMeter(pm)
    with meter:  # the first step: allocates the optimizer state and measures saved activations
        train_step(pm, opt, x, y, 1e-3, 1.0)
    result = {"case": case, "pp_rank": mesh.rank("pp"), "states": states, "activations": meter.peak}
    return lambda: train_step(pm, opt, x, y, 1e-3, 1.0), result


def measure_cases(
    cases: list[Case],
    model_cfg: ModelConfig,
    batch: int,
    micro_batch: int,
    seq_len: int,
    steps: int,
    warmup: int,
    calibrate: bool,
) -> dict:
    """Inside an initialised group: optionally calibrate (`meshlm doctor`), build every case, then time their
    steps round-robin (one step of each case per round, each between barriers), so that a change in the
    machine's load lands on every case alike rather than on whichever ran then. step_s: the median step."""
    report = None
    if calibrate:  # doctor's default sizes, 4 KiB to 16 MiB
        report = doctor(doctor_layout(cases), iters=20, budget_s=0.3, matmul_seconds=1.0)
    built = [build_case(case, model_cfg, batch, micro_batch, seq_len) for case in cases]
    times: list[list[float]] = [[] for _ in cases]
    for i in range(warmup + steps):
        for (step, _), case_times in zip(built, times, strict=True):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i >= warmup:
                case_times.append(time.perf_counter() - t0)
    out = [
        {**result, "step_s": statistics.median(t) if t else float("nan")}
        for (_, result), t in zip(built, times, strict=True)
    ]
    return {"report": report, "cases": out}


def doctor_layout(cases: list[Case]) -> str:
    """The layout doctor measures for a group of cases: the first of those with the most dims larger than 1,
    so that every dim the cases use is measured where possible (the others fall back to `links.intra`)."""
    return max(cases, key=lambda c: sum(size > 1 for size in c.sizes().values())).layout


def predict(case: Case, model_cfg: ModelConfig, batch: int, micro_batch: int, seq_len: int, cal: dict | None):
    layout = Candidate(
        Layout(**case.sizes()), ParallelOptions(zero=case.zero, schedule=case.schedule), micro_batch=micro_batch
    )
    w = Workload(model_cfg, seq_len, batch, train_tokens=1e9, precision="fp32")
    return layout, plan_strategy(w, layout, hardware("cpu", cal))


def stage_model_states(model_cfg: ModelConfig, layout: Candidate, stage: int) -> float:
    """The planner's params + grads + optimizer bytes of one pipeline stage's ranks."""
    layers = rank_layers(model_cfg, layout.pp, layout.virtual_stages)
    psi = stage_params(model_cfg, layout.tp, layers[stage], stage == 0, stage == layout.pp - 1)
    return sum(model_state_bytes(psi, layout.dp, layout.zero, "fp32"))


def busy_cores_s() -> float:
    """CPU seconds every process on the machine has spent so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cores_s() -> float:
    """CPU seconds of this process and its finished children (the ranks)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def run_world(world: int, cases: list[Case], args: argparse.Namespace, model_cfg: ModelConfig, calibrate: bool):
    fn_args = (cases, model_cfg, args.batch, args.micro_batch, args.seq_len, args.steps, args.warmup, calibrate)
    return run_distributed(measure_cases, world, *fn_args, timeout=600, pg_timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-world8", action="store_true", help="skip pp=2,dp=2,tp=2 on 8 ranks")
    args = p.parse_args()
    model_cfg = preset(args.preset)
    start = time.perf_counter()
    cases = CASES + ([] if args.no_world8 else WORLD8)
    print(
        "| layout | ranks | model states MiB pred / meas | ratio | activations MiB pred / meas | ratio "
        "| step ms pred / meas | ratio | predicted ms: compute / comm / bubble / optimizer "
        "| memory ≤10 % | time ≤25 % |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    calibrations = []
    mib = 2**20
    for world in sorted({c.world() for c in cases}):
        group = [c for c in cases if c.world() == world]
        start_world, busy, own = time.perf_counter(), busy_cores_s(), own_cores_s()
        results = run_world(world, group, args, model_cfg, calibrate=True)
        other = (busy_cores_s() - busy - (own_cores_s() - own)) / (time.perf_counter() - start_world)
        cal = calibration(results[0]["report"])
        calibrations.append((world, cal, other))
        for i, case in enumerate(group):
            per_rank = [r["cases"][i] for r in results]
            _, plan = predict(case, model_cfg, args.batch, args.micro_batch, args.seq_len, cal)
            mem, step = plan.memory, plan.step
            pred_states = mem.params + mem.grads + mem.optimizer
            meas_states = max(sum(r["states"].values()) for r in per_rank)
            pred_act = mem.activations + mem.logits
            meas_act = max(r["activations"] for r in per_rank)
            meas_t = max(r["step_s"] for r in per_rank)
            m_ratio, a_ratio, t_ratio = pred_states / meas_states, pred_act / meas_act, step.total / meas_t
            # ZeRO-3 frees gathered weights by resizing their storage, which the activation meter cannot see
            act_checked = case.zero != 3
            mem_ok = abs(m_ratio - 1) <= MEMORY_TOLERANCE and (abs(a_ratio - 1) <= MEMORY_TOLERANCE or not act_checked)
            time_ok = abs(t_ratio - 1) <= TIME_TOLERANCE
            parts = [step.compute, step.tp_comm + step.pp_comm + step.dp_comm, step.bubble, step.optimizer]
            print(
                f"| {case.name()} | {world} | {pred_states / mib:.2f} / {meas_states / mib:.2f} | {m_ratio:.3f} "
                f"| {pred_act / mib:.2f} / {meas_act / mib:.2f} | {a_ratio:.3f}{'' if act_checked else ' †'} "
                f"| {step.total * 1e3:.0f} / {meas_t * 1e3:.0f} | {t_ratio:.2f} "
                f"| {' / '.join(f'{t * 1e3:.0f}' for t in parts)} "
                f"| {'pass' if mem_ok else 'FAIL'} | {'pass' if time_ok else 'FAIL'} |",
                flush=True,
            )
    print(
        "\n† not checked: ZeRO-3's gathered weights, freed by storage resize, look like saved activations to the meter"
    )
    print(
        "\n| ranks | doctor layout | matmul GFLOP/s (machine, all cores) | memory GB/s "
        "| effective cores | other processes, cores | overhead µs: layer / micro-batch "
        "| all_reduce α µs, β GB/s (per dim) | send_recv α µs, β GB/s (per dim) |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---|---|")
    for world, cal, other in calibrations:
        fits = [
            " ".join(
                f"{dim} {ops[op]['alpha_s'] * 1e6:.0f}, {ops[op]['beta_Bps'] / 1e9:.2f};"
                for dim, ops in cal["dims"].items()
            ).rstrip(";")
            or "—"
            for op in ("all_reduce", "send_recv")
        ]
        overhead = f"{cal['layer_overhead_s'] * 1e6:.0f} / {cal['micro_batch_overhead_s'] * 1e6:.0f}"
        print(
            f"| {world} | {cal['notes']['layout']} | {cal['matmul_flops'] / 1e9:.1f} | {cal['memory_bw'] / 1e9:.1f} "
            f"| {cal['cores']:.2f} | {max(other, 0.0):.2f} | {overhead} | {fits[0]} | {fits[1]} |"
        )
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
