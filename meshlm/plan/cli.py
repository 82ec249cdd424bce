"""`meshlm plan`: rank the strategies that fit a model on a cluster, as a table or as JSON, price them on
demand, on spot and mixed (and replayed against a spot trace), and write a Slurm, Kubernetes or SkyPilot launch
file for the best one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from meshlm.config import load_config
from meshlm.model.config import PRESETS, ModelConfig, preset
from meshlm.model.flops import param_counts
from meshlm.observe.peak import DATASHEET_PEAK, MEASURED_MATMUL
from meshlm.plan.attention import KERNELS
from meshlm.plan.cost import CostModel, rates
from meshlm.plan.emit import (
    KUBERNETES_TARGETS,
    PVC,
    TARGET_SHAPES,
    TIME_LIMIT_S,
    Site,
    emit_flags,
    job_name,
    launch_for,
    skypilot,
    slurm,
)
from meshlm.plan.emit_groups import group_launch, group_plans, kubernetes_groups, skypilot_groups, slurm_groups
from meshlm.plan.emit_k8s import kubernetes, kubernetes_job
from meshlm.plan.hardware import GPUS, Hardware, hardware
from meshlm.plan.live import LiveVerdict, recommend
from meshlm.plan.memory import Assumptions, Workload
from meshlm.plan.replay import RUNS, Replay, Replays, check_deadline, replay_offerings
from meshlm.plan.search import Constraints, Plan, PlannerError, SearchResult, elastic_shrink, no_fit_message, search
from meshlm.plan.spot import Estimate, Shapes, duration_text
from meshlm.plan.table import COLUMNS, expert_parallel_note, fitted_table, legend, offer, row, si, why_first
from meshlm.plan.traces import FORMATS, Trace, load_trace

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
DURATIONS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_BATCH_TOKENS = 2**22  # when no batch is given: ~4M tokens per step
TOKENS_PER_PARAM = 20  # when no training length is given: compute-optimal (Hoffmann et al. 2022)
ASSUMED_MATMUL = "assumed matmul"  # cpu without a calibration: the hardware table's placeholder rate
EMIT_SUFFIX = {
    "slurm": ".sbatch",
    "kubernetes": ".pytorchjob.json",
    "kubernetes-job": ".job.json",
    "skypilot": ".sky.yaml",
}


def count(text: str) -> float:
    """'15T' -> 1.5e13, '16Mi' -> 2**24 * 1, '2.5e12' -> 2.5e12 (K/M/B/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    match = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([KMBGT]i?)?", text.strip())
    if not match or (match[2] and match[2] not in SUFFIXES):
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 16M, 15T, 16Mi, 2.5e12)")
    return float(match[1]) * SUFFIXES.get(match[2] or "", 1)


def duration(text: str) -> float:
    """'30d' -> 2592000.0 seconds; units s, m/min, h, d, w."""
    match = re.fullmatch(r"([0-9.]+)\s*([a-z]+)", text.strip())
    if not match or match[2] not in DURATIONS or not re.fullmatch(r"[0-9]+(\.[0-9]+)?", match[1]):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30d, 12h, 90min, 3600s)")
    return float(match[1]) * DURATIONS[match[2]]


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a GPU count or list: {text!r} (e.g. 64 or 8,16,32)") from None
    if any(n <= 0 for n in counts):
        raise argparse.ArgumentTypeError(f"GPU counts must be > 0: {text!r}")
    return counts


def fixed_dims(text: str) -> dict[str, int]:
    """'tp=8,pp=16,dp=8' -> {'tp': 8, 'pp': 16, 'dp': 8}; dims left out (of pp, dp, ep, cp, tp) are searched."""
    dims: dict[str, int] = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in ("pp", "dp", "ep", "cp", "tp") or not value.isdigit() or int(value) < 1 or name in dims:
            raise PlannerError(f"layout {text!r}: expected comma-separated pp=N, dp=N, ep=N, cp=N, tp=N")
        dims[name] = int(value)
    return dims


@dataclass(frozen=True)
class ModelSource:
    """A model shape and where it came from: how `meshlm train` selects it, and the run settings a meshlm
    config brings along (defaults for --seq-len, --global-batch, --train-tokens, --precision)."""

    model: ModelConfig
    name: str
    train_args: tuple[str, ...]
    seq_len: int | None = None
    global_batch: int | None = None
    train_tokens: float | None = None
    precision: str | None = None
    data_source: str | None = None  # a meshlm config's data.source


def _shape_args(model: ModelConfig) -> tuple[str, ...]:
    """`meshlm train` overrides that build exactly this shape (any preset, every field replaced)."""
    args = ["--model.preset", "tiny"]
    for key, value in model.to_dict().items():
        args += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return tuple(args)


def resolve_model(text: str) -> ModelSource:
    """--model: a preset name, a meshlm TOML run config, or a Hugging Face config.json (or its folder), read
    by meshlm's own importer (meshlm.model.hf), so every family meshlm imports plans."""
    if text in PRESETS:
        return ModelSource(preset(text), text, ("--model.preset", text))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix not in (".toml", ".json"):
        raise PlannerError(
            f"--model {text!r}: not a preset ({', '.join(PRESETS)}), a meshlm .toml run config, or a Hugging Face "
            "config.json (file or folder)"
        )
    if not path.is_file():
        raise PlannerError(f"--model {text}: file {path} not found")
    if path.suffix == ".toml":
        cfg = load_config(path)
        tokens = cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
        precision = None if cfg.train.dtype == "auto" else cfg.train.dtype
        return ModelSource(
            cfg.model.build(),
            path.stem,
            ("--config", str(path)),
            cfg.data.seq_len,
            cfg.train.global_batch,
            tokens,
            precision,
            cfg.data.source,
        )
    from meshlm.model.hf import model_config_from_hf

    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlannerError(f"--model {path}: not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise PlannerError(f"--model {path}: expected a JSON object (a Hugging Face config.json)")
    try:
        model = model_config_from_hf(hf)
    except ValueError as e:
        raise PlannerError(f"--model {path}: {str(e).removeprefix('config.json: ')}") from None
    name = str(hf.get("_name_or_path") or path.parent.name or path.stem).rstrip("/").split("/")[-1]
    return ModelSource(model, name, _shape_args(model))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `plan` on a subparsers object."""
    p = subparsers.add_parser("plan", help="rank parallel layouts by predicted memory, speed and cost")
    _add_workload_args(p)
    _add_layout_args(p)
    _add_model_args(p)
    _add_money_args(p)
    _add_trace_args(p)
    _add_output_args(p)
    p.set_defaults(func=run_plan)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """What to train and on what: the model, the batch, the training length, the devices."""
    p.add_argument(
        "--model", required=True, help="a preset (e.g. llama3-70b), a meshlm .toml config, or an HF config.json"
    )
    p.add_argument("--seq-len", type=positive, help="tokens per sequence (default: the config's, or max_seq_len)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=positive, help="sequences per optimizer step")
    batch.add_argument("--global-batch-tokens", type=count, help="tokens per step, e.g. 16Mi (default 4Mi)")
    p.add_argument("--train-tokens", type=count, help="total training tokens, e.g. 15T (default 20 per parameter)")
    p.add_argument("--gpu", help="device type: A100-40GB, A100-80GB, H100-SXM, H200, cpu (default H100-SXM)")
    p.add_argument("--gpus", type=gpu_counts, required=True, help="device count, or a list to compare: 8,16,32")
    p.add_argument("--calibration", type=Path, help="JSON from `meshlm doctor` (docs/planner.md)")
    p.add_argument("--precision", choices=["bf16", "fp32"], help="default: fp32 on cpu, bf16 on GPUs")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    """Choices to fix (the rest is searched), and LoRA."""
    fixed = p.add_argument_group("fix part of the layout (the rest is searched)")
    fixed.add_argument("--layout", default="", help="e.g. tp=8,pp=16,dp=8 (cp=N, ep=N too)")
    fixed.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    fixed.add_argument("--micro-batch", type=positive, help="sequences per micro-batch per replica")
    fixed.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb1"])
    fixed.add_argument("--virtual-stages", type=positive)
    fixed.add_argument("--recompute", choices=["none", "selective", "mlp", "full"])
    fixed.add_argument(
        "--recompute-layers",
        type=non_negative,
        help="blocks per pipeline chunk fully recomputed (default: the fewest that fit)",
    )
    fixed.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    fixed.add_argument("--even-layers", action="store_true", help="require n_layers divisible by the pipeline split")
    p.add_argument(
        "--lora-rank", type=positive, help="LoRA fine-tune: adapters of this rank, the base frozen (docs/lora.md)"
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Assumptions of the step-time and memory model."""
    model = p.add_argument_group("model assumptions (docs/planner.md)")
    model.add_argument(
        "--runtime", choices=["meshlm", "megatron"], default="meshlm", help="whose kernels and split run the step"
    )
    model.add_argument("--compute-efficiency", type=float, help="GEMM rate / peak (device table) or / measured (0.8)")
    model.add_argument("--dp-overlap", type=float, help="fraction of backward hiding DP communication (0.8; cpu 0)")
    model.add_argument("--tp-overlap", type=float, default=0.0, help="fraction of TP communication hidden")
    model.add_argument("--overhead-gb", type=float, help="fixed framework memory per device (GPU 2, cpu 0.5)")
    model.add_argument("--memory-gb", type=float, help="usable memory per device (default: the device's)")
    model.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True)
    model.add_argument("--attention-kernel", choices=KERNELS, default="flash2",
                       help="the flash kernel: its published rate by sequence length (default flash2)")  # fmt: skip
    model.add_argument("--backward-prefetch", choices=["pre", "post"], default="pre",
                       help="ZeRO-3 backward gathers: prefetched, or after a unit's gradients (FSDP1)")  # fmt: skip
    model.add_argument(
        "--moe-dispatcher",
        choices=["alltoall", "allgather"],
        default="alltoall",
        help="expert token dispatch (Megatron's --moe-token-dispatcher-type; --runtime megatron)",
    )
    model.add_argument(
        "--moe-capacity-factor",
        type=float,
        help="Megatron's --moe-expert-capacity-factor: "
        "tokens over capacity dropped (default: dropless; --runtime megatron)",
    )
    model.add_argument("--moe-pad-to-capacity", action="store_true",
                       help="Megatron's --moe-pad-expert-input-to-capacity (needs --moe-capacity-factor)")  # fmt: skip
    model.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=True,
                       help="meshlm's train.fused_loss (the megatron runtime's loss is unfused)")  # fmt: skip


def _add_money_args(p: argparse.ArgumentParser) -> None:
    """Prices, failures and spot preemptions."""
    money = p.add_argument_group("cost, failures and spot (docs/planner.md)")
    money.add_argument("--price-on-demand", type=float, help="$ per GPU-hour (default: hardware table)")
    money.add_argument("--price-spot", type=float, help="$ per GPU-hour on spot (default: hardware table)")
    money.add_argument("--failure-rate", type=float, help="hardware interruptions per GPU-hour (Llama 3: ~2e-5)")
    money.add_argument("--preemption-rate", type=float, default=1e-3, help="spot preemptions per --preemption-per")
    money.add_argument("--preemption-per", choices=["gpu-hour", "node-hour", "job-hour"], default="gpu-hour")
    money.add_argument("--replace-s", type=float, default=3600.0, help="mean time until a preempted node is back")
    money.add_argument("--restart-s", type=float, default=600.0, help="restart overhead besides reading the checkpoint")
    money.add_argument("--storage-gbps", type=float, default=20.0, help="checkpoint storage bandwidth, GB/s")
    money.add_argument("--deadline", type=duration, help="wall-time limit, e.g. 30d: pools that miss it are not used")


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    """Replaying the best plan against a spot trace."""
    trace = p.add_argument_group("spot trace replay (docs/planner.md)")
    trace.add_argument("--spot-trace", type=Path, help="replay #1's pools against this trace (spot-traces .json, .csv)")
    trace.add_argument("--trace-format", choices=FORMATS, default="auto", help="default: by the file's suffix")
    trace.add_argument("--replay-runs", type=positive, default=RUNS, help="Monte-Carlo runs (random start offsets)")
    trace.add_argument("--replay-seed", type=int, default=0, help="seed of the start offsets and draws")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Ranking, output and the launch file."""
    out = p.add_argument_group("output")
    out.add_argument("--objective", choices=["throughput", "cost"], default="throughput")
    out.add_argument("--top", type=positive, default=10, help="layouts to show")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--emit", choices=list(EMIT_SUFFIX), help="write a launch file for the best plan")
    out.add_argument("--replica-groups", type=positive, default=1, help="run as N fault-tolerant replica groups "
                     "joined by a lighthouse (--emit writes them; a spot trace prices live recovery with N; "
                     "docs/fault-tolerance.md)")  # fmt: skip
    out.add_argument("--check", action="store_true", help="the launch file runs `meshlm check` with the run's "
                     "config on one node before training, which a failure stops (docs/check.md)")  # fmt: skip
    out.add_argument("--emit-to", type=Path, help="where to write it (default: meshlm-NAME.sbatch / .pytorchjob.json"
                     " / .sky.yaml)")  # fmt: skip
    out.add_argument("--image", help="container image with meshlm installed (--emit kubernetes)")
    out.add_argument("--bucket", help="bucket for the run directory, e.g. s3://my-bucket/runs (--emit skypilot)")
    out.add_argument("--data-source", help="the corpus the launch trains on (data.source; default: the --model "
                     "config's); --emit needs one")  # fmt: skip
    out.add_argument("--install", help="what the launch pip-installs: a requirement such as 'meshlm==0.1.0' or a "
                     "meshlm wheel (a path or URL ending in .whl; --emit slurm and skypilot need one)")  # fmt: skip
    out.add_argument("--run-dir", help="run directory on shared storage (--emit slurm; default: "
                     "$SLURM_SUBMIT_DIR/runs/NAME)")  # fmt: skip
    out.add_argument("--pvc", default=PVC, help="ReadWriteMany claim for the run directory (--emit kubernetes)")
    out.add_argument("--time-limit", type=duration, default=TIME_LIMIT_S, help="Slurm --time of one allocation; "
                     "the job requeues itself at its end (default 1d)")  # fmt: skip
    out.add_argument("--partition", default="", help="Slurm partition (--emit slurm)")
    out.add_argument("--account", default="", help="Slurm account (--emit slurm)")
    out.add_argument("--spot-selector", default=Site.spot_selector, help="node label KEY=VALUE of spot nodes "
                     "(--emit kubernetes; GKE: cloud.google.com/gke-spot=true)")  # fmt: skip


@dataclass(frozen=True)
class Request:
    """Everything `meshlm plan` was asked, as planner inputs."""

    source: ModelSource
    workload: Workload
    hw: Hardware
    constraints: Constraints
    assumptions: Assumptions
    costs: CostModel
    trace: Trace | None = None


def _request(args: argparse.Namespace) -> Request:
    """Turn parsed arguments into planner inputs; every problem becomes a one-line ValueError."""
    calibration = None
    if args.calibration is not None:
        try:
            calibration = json.loads(args.calibration.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlannerError(f"calibration {args.calibration}: {e}") from None
    hw = hardware(args.gpu or (None if calibration else "H100-SXM"), calibration)
    source = resolve_model(args.model)
    model = source.model
    seq_len = args.seq_len or source.seq_len or model.max_seq_len
    if seq_len > model.max_seq_len:
        raise PlannerError(f"--seq-len {seq_len} exceeds {source.name}'s max_seq_len {model.max_seq_len}")
    if model.sliding_window and seq_len > model.sliding_window:
        raise PlannerError(
            f"--seq-len {seq_len} exceeds {source.name}'s sliding_window {model.sliding_window} (meshlm trains "
            "full causal attention, equal to the window only up to its length)"
        )
    tokens = args.global_batch_tokens or DEFAULT_BATCH_TOKENS
    global_batch = args.global_batch or (None if args.global_batch_tokens else source.global_batch)
    global_batch = global_batch or max(1, round(tokens / seq_len))
    train_tokens = args.train_tokens or source.train_tokens or TOKENS_PER_PARAM * param_counts(model)["total"]
    precision = args.precision or source.precision or ("fp32" if hw.shared_node else "bf16")
    w = Workload(model, seq_len, global_batch, train_tokens, precision, source.name, args.lora_rank or 0)
    if args.check and not args.emit:
        raise PlannerError("--check goes into a launch file: it needs --emit slurm, kubernetes or skypilot")
    if args.check and args.replica_groups > 1:
        raise PlannerError(f"--check with --replica-groups {args.replica_groups}: the check's runs would join the "
                           "lighthouse; run `meshlm check` on the run's config before the groups")  # fmt: skip
    if args.emit:
        args.install = emit_flags(args.emit, args.image, args.bucket, args.data_source or source.data_source,
                                  args.install)  # fmt: skip
    if args.emit in KUBERNETES_TARGETS and "=" not in args.spot_selector:
        raise PlannerError(f"--spot-selector {args.spot_selector!r}: expected a node label KEY=VALUE")
    trace = load_trace(args.spot_trace, args.trace_format) if args.spot_trace is not None else None
    c = Constraints(
        **fixed_dims(args.layout),
        zero=0 if args.zero is None and args.replica_groups > 1 else args.zero,  # replica groups: ZeRO 0
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=args.recompute,
        recompute_layers=args.recompute_layers,
        sequence_parallel=args.sequence_parallel,
        uneven_layers=not args.even_layers,
        memory_gb=args.memory_gb,
    )
    _check_moe_args(args)
    a = Assumptions(runtime=args.runtime, flash_attention=args.flash_attention, fused_loss=args.fused_loss,
                    attention_kernel=args.attention_kernel, moe_dispatcher=args.moe_dispatcher,
                    backward_prefetch=args.backward_prefetch,
                    moe_capacity_factor=args.moe_capacity_factor, moe_pad_to_capacity=args.moe_pad_to_capacity,
                    overhead_gb=args.overhead_gb, compute_efficiency=args.compute_efficiency,
                    dp_overlap=args.dp_overlap, tp_overlap=args.tp_overlap)  # fmt: skip
    costs = CostModel(
        price_on_demand=args.price_on_demand,
        price_spot=args.price_spot,
        preemption_rate=args.preemption_rate,
        preemption_per=args.preemption_per,
        replace_s=args.replace_s,
        restart_s=args.restart_s,
        storage_gbps=args.storage_gbps,
        deadline_s=args.deadline,
        shapes=_shapes(args),
        **({} if args.failure_rate is None else {"failure_rate": args.failure_rate}),
    )
    return Request(source, w, hw, c, a, costs, trace)


def _check_moe_args(args: argparse.Namespace) -> None:
    """The MoE dispatch flags price Megatron's dispatcher: meshlm's own layer is dropless and all-to-all."""
    factor = args.moe_capacity_factor
    if factor is not None and not factor > 0:
        raise PlannerError(f"--moe-capacity-factor {factor}: expected a positive number (1.0: each expert's share)")
    if args.moe_pad_to_capacity and factor is None:
        raise PlannerError("--moe-pad-to-capacity: needs --moe-capacity-factor (the capacity it pads to)")
    if args.runtime != "megatron" and (args.moe_dispatcher != "alltoall" or factor is not None):
        raise PlannerError(
            "--moe-dispatcher allgather / --moe-capacity-factor: Megatron's dispatcher, valid with --runtime "
            "megatron (meshlm's MoE layer is dropless and dispatches by all-to-all)"
        )


def run_plan(args: argparse.Namespace) -> int:
    """Run `meshlm plan`; 0 on success, 2 with a one-line message when nothing can be planned."""
    try:
        r = _request(args)
        result = search(
            r.workload, args.gpus, r.hw, args.objective, r.constraints, r.assumptions, r.costs, priced=args.top
        )
        if not result.plans:
            raise PlannerError(no_fit_message(r.workload, args.gpus, r.hw, r.constraints, r.assumptions, result))
        result = group_plans(result, args.replica_groups, r.workload.global_batch)
        if r.costs.deadline_s is not None:  # not even the fastest plan on demand meets it: one line, no table
            fastest = min(result.plans, key=lambda p: p.on_demand.wall_s)
            check_deadline(r.costs.deadline_s, fastest.on_demand, f" of the fastest plan ({fastest.strategy.layout})")
        replays = _replay(args, r, result.plans[0]) if r.trace is not None else None
        live = _live_verdict(args, r, result.plans[0], replays) if replays is not None else None
        if args.emit:
            _emit(args, r, result.plans[0], replays.recommended.closed if replays is not None else None)
    except (ValueError, OSError) as e:  # PlannerError, ConfigError, unknown gpu / preset, bad calibration, unwritable
        print(f"meshlm plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        summary = _request_summary(r, args, result)
        if replays is not None:
            verdict = live.to_dict() if isinstance(live, LiveVerdict) else live
            summary["replay"] = {"trace": r.trace.source, "runs": args.replay_runs, **replays.to_dict(),
                                 "live_recovery": verdict}  # fmt: skip
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        _print_table(r, args, result)
        if replays is not None:
            _print_replay(r, args, replays)
            Console(width=max(Console().width, 200)).print(
                f"#1 on {r.trace.source}: {_live_text(live)}", soft_wrap=True
            )
    return 0


def _shapes(args: argparse.Namespace) -> Shapes:
    """The pools priced: the launcher's (`TARGET_SHAPES`); replica groups are rigid (a group, not the
    rendezvous, is what shrinks), and only Slurm's allocation holds spares for their relaunches."""
    shapes = TARGET_SHAPES[args.emit] if args.emit else CostModel.shapes
    if args.replica_groups > 1:
        shapes = dataclasses.replace(shapes, elastic=False, spares=shapes.spares and args.emit in (None, "slurm"))
    return shapes


def _live_verdict(args: argparse.Namespace, r: Request, plan: Plan, replays: Replays) -> LiveVerdict | str:
    """Live recovery against checkpoint restart on the trace, for the recommended pool."""
    job = rates(plan.strategy.gpus, plan.checkpoint_bytes, r.hw, r.costs)
    groups = args.replica_groups if args.replica_groups > 1 else 0
    return recommend(plan, r.workload.global_batch, job, r.trace, replays.recommended, groups, args.replay_runs,
                     args.replay_seed)  # fmt: skip


def _live_text(live: LiveVerdict | str) -> str:
    if isinstance(live, str):
        return live
    hint = f" (--replica-groups {live.groups} --emit writes it)" if live.recommended == "live recovery" else ""
    return live.line() + hint


def _replay(args: argparse.Namespace, r: Request, plan: Plan) -> Replays:
    """The best plan's on-demand, spot and mixed pools replayed against the trace (with the deadline policy)."""
    s = plan.strategy
    offers = plan.offerings
    speed, _ = elastic_shrink(r.workload, s, r.hw, r.assumptions, r.constraints)
    work = plan.step.train_days * 86400
    job = rates(s.gpus, plan.checkpoint_bytes, r.hw, r.costs)
    return replay_offerings(work, offers, job, r.trace, speed, args.replay_runs, args.replay_seed,
                            r.costs.deadline_s, r.workload.train_tokens)  # fmt: skip


def _print_replay(r: Request, args: argparse.Namespace, replays: Replays) -> None:
    """One line per pool: replayed p50/p90 beside the closed form (and the deadline share, $/token)."""
    console = Console(width=max(Console().width, 200))
    console.print(f"#1 replayed on {r.trace.source} ({args.replay_runs} runs from random start offsets):")
    (rate, away), (assumed_rate, assumed_away) = replays.fitted, replays.assumed
    console.print(f"  the trace: {rate:.3g} preemptions/node-hour, a lost node away {duration_text(away)} on "
                  f"average; the closed form: {assumed_rate:.3g}/node-hour, {duration_text(assumed_away)}",
                  soft_wrap=True)  # fmt: skip
    base = replays.on_demand.usd_per_token
    for rp in (replays.on_demand, replays.spot, replays.mixed):
        if rp is not None:
            console.print(f"  {_replay_text(rp, base)}", soft_wrap=True)
    console.print(f"#1 recommended on {r.trace.source}: {replays.recommended.pool.describe()}", soft_wrap=True)


def _replay_text(rp: Replay, on_demand_per_token: float | None) -> str:
    closed = rp.closed
    form = f"closed form {offer(closed, None)}" if closed.feasible else "closed form cannot finish"
    if not rp.feasible:
        return f"{rp.pool.describe()}: {rp.reason} ({form})"
    text = (f"{rp.pool.describe()}: p50 ${si(rp.usd_p50)}, {duration_text(rp.wall_p50)}, {rp.restarts_p50:,.0f} "
            f"restarts; p90 ${si(rp.usd_p90)}, {duration_text(rp.wall_p90)} ({form})")  # fmt: skip
    if rp.met is not None:
        text += f"; meets the deadline in {rp.met:.0%} of runs"
    if rp.usd_per_token is not None and on_demand_per_token:
        text += f", ${rp.usd_per_token * 1e6:.3g}/M tokens ({rp.usd_per_token / on_demand_per_token:.0%} of on demand)"
    return text


def _emit(args: argparse.Namespace, r: Request, plan: Plan, pick: Estimate | None = None) -> None:
    """Write the launch file of the best plan on `pick` (the pool recommended on the spot trace, else by the
    closed form) and say where, on stderr."""
    w = r.workload
    pick = pick or plan.cost
    launch = launch_for(plan, list(r.source.train_args), w.seq_len, w.global_batch, w.train_tokens, w.name, pick,
                        w.precision, gpu=r.hw.name != "cpu", window_s=args.time_limit,
                        storage_gbps=r.costs.storage_gbps, fused_loss=r.assumptions.fused_loss)  # fmt: skip
    summary = f"{w.name} on {plan.strategy.gpus}× {r.hw.name}: {plan.strategy}, {pick.pool.describe()}"
    if args.replica_groups > 1:
        summary += f", {args.replica_groups} replica groups"
    launch = dataclasses.replace(launch, summary=summary)
    site = Site(args.data_source or r.source.data_source or "", args.install or "", args.run_dir or "",
                args.time_limit, partition=args.partition, account=args.account, pvc=args.pvc, bucket=args.bucket or "",
                spot_selector=args.spot_selector, check=args.check)  # fmt: skip
    groups = args.replica_groups
    if groups > 1:
        group = group_launch(launch, plan.strategy, groups)
        if args.emit == "slurm":
            text = slurm_groups(launch, group, groups, site)
        elif args.emit in KUBERNETES_TARGETS:
            text = kubernetes_groups(group, groups, site, args.image, indexed=args.emit == "kubernetes-job")
        else:
            text = skypilot_groups(group, groups, site, pick.pool, r.hw)
    elif args.emit == "slurm":
        text = slurm(launch, site)
    elif args.emit == "kubernetes":
        text = kubernetes(launch, site, args.image)
    elif args.emit == "kubernetes-job":
        text = kubernetes_job(launch, site, args.image)
    else:
        text = skypilot(launch, site, pick.pool, r.hw)
    path = args.emit_to or Path(job_name(w.name) + EMIT_SUFFIX[args.emit])
    path.write_text(text)
    if args.emit == "slurm":
        path.chmod(0o755)
    print(f"meshlm plan: wrote {path} ({summary})", file=sys.stderr)


def _mfu_basis(hw: Hardware, args: argparse.Namespace) -> str:
    """What the predicted MFU is a fraction of, in the trainer's words (`meshlm.observe.peak.mfu_basis`):
    a table GPU's datasheet peak, else (cpu, a GPU known only from its calibration) a matmul rate."""
    if hw.name in GPUS:
        return DATASHEET_PEAK
    return MEASURED_MATMUL if args.calibration is not None else ASSUMED_MATMUL


def _request_summary(r: Request, args: argparse.Namespace, result: SearchResult) -> dict:
    w = r.workload
    return {
        "model": w.name,
        "params": param_counts(w.model)["total"],
        "hardware": r.hw.name,
        "gpus": args.gpus,
        "seq_len": w.seq_len,
        "global_batch": w.global_batch,
        "train_tokens": w.train_tokens,
        "precision": w.precision,
        "runtime": r.assumptions.runtime,
        "objective": args.objective,
        "mfu_of": _mfu_basis(r.hw, args),
        "deadline_days": None if r.costs.deadline_s is None else r.costs.deadline_s / 86400,
        "fitting": len(result.plans),
        "rejected": dict(result.reasons().most_common()),
        "plans": [p.to_dict() for p in result.plans[: args.top]],
    }


def _print_table(r: Request, args: argparse.Namespace, result: SearchResult) -> None:
    w, hw = r.workload, r.hw
    counts = param_counts(w.model)
    params = si(counts["total"]) + (f", {si(counts['active'])} active" if w.model.n_experts else "")
    gpus = ",".join(map(str, args.gpus))
    title = (
        f"{w.name} ({params} params) on {gpus}× {hw.name}: seq {w.seq_len}, batch {w.global_batch} "
        f"({si(w.global_batch * w.seq_len)} tokens), {si(w.train_tokens)} training tokens, {w.precision}"
    )
    rows = [row(i, plan) for i, plan in enumerate(result.plans[: args.top], 1)]
    width = shutil.get_terminal_size().columns  # $COLUMNS, else the terminal's, else 80
    console = Console(width=width)
    table, dropped = fitted_table(title, rows, console)
    console.print(table)
    for note in legend(table, rows):
        console.print(note)
    if dropped:
        hidden = ", ".join(name for name in COLUMNS if name in dropped)
        console.print(f"not shown at {width} columns: {hidden} (a wider terminal or --json shows them)")
    basis = _mfu_basis(hw, args)
    hint = " (`meshlm doctor --out FILE`, then --calibration FILE, measures it)" if basis == ASSUMED_MATMUL else ""
    console.print(f"MFU: of {basis}{hint}")
    o = result.plans[0].offerings
    lines = [f"#1 recommended: {o.recommended.pool.describe()}"]
    lines += [f"#1 {name}: {note}"
              for name, note in (("spot", o.spot_note), ("mixed", o.mixed_note)) if note]  # fmt: skip
    lines += [f"#1: {o.note}"] if o.note.startswith("nothing finishes") else []
    lines += [line for line in (why_first(result.plans, hw), expert_parallel_note(result.plans, w.model)) if line]
    for line in lines:
        console.print(line, soft_wrap=True)
    rejected = ", ".join(f"{reason} ×{n}" for reason, n in result.reasons().most_common())
    console.print(f"{len(result.plans)} layouts fit; rejected {len(result.rejected)}: {rejected or 'none'}")
