"""The training loop: config in, checkpoints and metrics out. Parallelism enters only via ParallelModel."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from meshlm.config import Config, to_toml
from meshlm.data import GlobalBatchSampler, TokenData, eval_batches, prepare_data
from meshlm.model import Transformer, flops_per_token
from meshlm.observe import StepObserver, aggregate
from meshlm.observe.env import environment
from meshlm.observe.metrics import MetricsLogger, TrainProgress
from meshlm.observe.profile import StepProfiler
from meshlm.parallel.engine import ParallelModel
from meshlm.parallel.mesh import Layout, build_mesh, parse_layout, validate_layout
from meshlm.train.distributed import autocast_dtype, env_rank, env_world_size, init_distributed, resolve_device
from meshlm.train.guards import Preemption, StepGuard, Watchdog, check_replicas_in_sync
from meshlm.train.optim import build_optimizer, lr_at, train_step


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    preempted: bool = False


def check_config(cfg: Config, world_size: int) -> tuple[Layout, int]:
    """Every layout check that needs no process group: fails fast, before data or model work."""
    layout = parse_layout(cfg.parallel.layout, world_size)
    n_micro = validate_layout(
        layout,
        cfg.model.build(),
        cfg.train.global_batch,
        cfg.train.micro_batch,
        cfg.parallel.virtual_stages,
        cfg.parallel.schedule,
        cfg.data.seq_len,
        cfg.parallel.sequence_parallel,
    )
    return layout, n_micro


def resolve_auto_layout(cfg: Config, world_size: int) -> Config:
    """`--parallel.layout auto`: the planner's fastest layout for this model, batch and world size."""
    if cfg.parallel.layout != "auto":
        return cfg
    from meshlm.plan import plan_for_config

    choice = plan_for_config(cfg, world_size)
    data = cfg.model_dump()
    for key, value in choice.overrides().items():
        section, name = key.split(".")
        data[section][name] = value
    return Config.model_validate(data)


def optimizer_is_resumable(layout: Layout, zero: int) -> bool:
    """Layouts whose rank-0 optimizer state is the whole state (the others arrive with sharded checkpoints)."""
    return layout.tp == 1 and layout.pp == 1 and zero == 0


def load_data(cfg: Config, vocab_size: int) -> TokenData:
    """Rank 0 tokenizes (once, cached on disk); the other ranks then read the same cache."""
    if dist.get_rank() == 0:
        data = prepare_data(cfg.data, vocab_size)
    dist.barrier()
    if dist.get_rank() != 0:
        data = prepare_data(cfg.data, vocab_size)
    return data


def evaluate(model: ParallelModel, data: TokenData, cfg: Config, dp_rank: int, dp: int) -> float:
    """Mean loss over a fixed set of validation batches (the same windows every time)."""
    device = model_device(model)
    losses = [
        model.eval_loss(x.to(device), y.to(device)).item()
        for x, y in eval_batches(
            data.val, cfg.data.seq_len, cfg.train.global_batch, cfg.train.eval_batches, dp_rank, dp
        )
    ]
    return sum(losses) / len(losses)


def model_device(model: ParallelModel) -> torch.device:
    return next(model.chunks[0].parameters()).device


def train(cfg: Config) -> TrainResult:
    """Train (or resume) the run in `cfg.log.run_dir`; return the losses of this invocation."""
    world_size = env_world_size()
    cfg = resolve_auto_layout(cfg, world_size)
    layout, n_micro = check_config(cfg, world_size)
    device = resolve_device(cfg.train.device)
    # Armed before the process group exists: a restarted rank can hang in rendezvous or set-up too.
    watchdog = Watchdog(Path(cfg.log.run_dir), env_rank(), cfg.fault.watchdog_s)
    watchdog.arm()
    created_group = init_distributed(device, cfg.parallel.timeout_s)
    try:
        return _train(cfg, layout, n_micro, device, watchdog)
    finally:
        watchdog.close()
        if created_group:
            dist.destroy_process_group()


def _train(cfg: Config, layout: Layout, n_micro: int, device: torch.device, watchdog: Watchdog) -> TrainResult:
    rank = dist.get_rank()
    run_dir = Path(cfg.log.run_dir)
    model_cfg = cfg.model.build()
    watchdog.disarm()
    data = load_data(cfg, model_cfg.vocab_size)
    watchdog.arm()
    sampler = GlobalBatchSampler(data.train, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)

    torch.manual_seed(cfg.train.seed)
    model = Transformer(model_cfg)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    say = print if rank == 0 else (lambda *_: None)
    resumable = optimizer_is_resumable(layout, cfg.parallel.zero)
    checkpoint = latest_valid_checkpoint(run_dir, warn=say) if cfg.checkpoint.resume else None
    optimizer_state = None
    if checkpoint is not None:
        model_state, trainer_state, optimizer_state = load_checkpoint(checkpoint)
        model.load_state_dict(model_state)
        sampler.load_state_dict(trainer_state["sampler"])
        if optimizer_state is None or not resumable:
            say(f"warning: {checkpoint} restores weights only under layout {layout}; Adam moments restart")
            optimizer_state = None
        say(f"resuming from {checkpoint} at step {sampler.step}")
    model.to(device)

    mesh = build_mesh(layout, device.type)
    pm = ParallelModel(model, mesh, cfg.parallel, n_micro, autocast_dtype(cfg.train.dtype, device))
    optimizer = build_optimizer(pm, cfg.train)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    dp_rank, dp = mesh.rank("dp"), layout.dp

    result = TrainResult(run_dir=run_dir, start_step=sampler.step, final_step=sampler.step)
    logger = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    flops_per_step = flops_per_token(model_cfg, cfg.data.seq_len) * tokens_per_step
    dist.barrier()  # ranks sharing a CPU measure its matmul peak together
    observer = StepObserver(
        flops_per_step, tokens_per_step, n_devices=dist.get_world_size(), device=device,
        peak_flops=cfg.log.peak_flops or None, model=pm, optimizer=optimizer, activations=cfg.log.activation_memory,
    )  # fmt: skip
    profiler = StepProfiler(cfg.log.profile_steps, run_dir / "profile", rank, device)
    if logger:
        logger.log(sampler.step, "env", **environment(device, str(layout)), peak_flops=observer.peak_flops)

    def save(step: int) -> None:
        state = pm.full_state_dict()
        if rank == 0:
            trainer_state = {
                "step": step,
                "sampler": sampler.state_dict(),
                "layout": str(layout),
                "model": model_cfg.to_dict(),
            }
            save_checkpoint(
                run_dir,
                step,
                state,
                trainer_state,
                optimizer.state_dict() if resumable else None,
                keep=cfg.checkpoint.keep,
            )
        dist.barrier()

    preemption = Preemption()
    guard = StepGuard(cfg.fault.nonfinite, cfg.fault.spike_factor)
    check_desync = cfg.fault.desync_every and layout.dp > 1 and cfg.parallel.zero < 3
    try:
        with TrainProgress(cfg.train.steps, sampler.step, enabled=cfg.log.progress and rank == 0) as progress:
            watchdog.arm()
            if result.start_step == 0 and cfg.train.eval_every:
                result.eval_losses.append((0, evaluate(pm, data, cfg, dp_rank, dp)))
                if logger:
                    logger.log(0, "eval", loss=result.eval_losses[-1][1])
            while sampler.step < cfg.train.steps:
                step = sampler.step
                profiler.before_step(step + 1)
                observer.start_step()
                with observer.data_wait():
                    inputs, targets = sampler.next_batch(dp_rank, dp)
                lr = lr_at(step, cfg.train)
                loss, grad_norm, applied = train_step(
                    pm, optimizer, inputs.to(device), targets.to(device), lr, cfg.train.grad_clip, guard.allow
                )
                metrics = observer.end_step()
                watchdog.arm()
                result.losses.append(loss)
                done = step + 1
                if trace := profiler.after_step(done):
                    progress.print(f"profiler trace: {trace}")
                progress.update(done, loss, metrics["tokens_per_s"], extra=f"MFU {metrics['mfu']:.1%}")
                if not applied:
                    result.skipped_steps.append(done)
                    progress.print(f"step {done}: update skipped: {guard.last_reason}")
                    if logger:
                        logger.log(done, "fault", skipped=1, loss=loss, grad_norm=grad_norm, reason=guard.last_reason)
                if logger and (done % cfg.log.every == 0 or done == cfg.train.steps or done == 1):
                    logger.log(
                        done,
                        "train",
                        loss=loss,
                        grad_norm=grad_norm,
                        lr=lr,
                        **metrics,
                    )
                if cfg.log.aggregate_every and (done % cfg.log.aggregate_every == 0 or done == cfg.train.steps):
                    summary = aggregate(metrics, cfg.log.straggler_threshold)
                    if logger:
                        logger.log(done, "ranks", **summary)
                    if summary.get("straggler_rank", -1) >= 0:
                        progress.print(
                            f"step {done}: rank {summary['straggler_rank']:.0f} is a straggler "
                            f"({summary['straggler_ratio']:.2f}× the median compute time)"
                        )
                if check_desync and done % cfg.fault.desync_every == 0:
                    check_replicas_in_sync(pm)
                if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                    val = evaluate(pm, data, cfg, dp_rank, dp)
                    result.eval_losses.append((done, val))
                    progress.print(f"step {done}: train loss {loss:.4f}, val loss {val:.4f}")
                    if logger:
                        logger.log(done, "eval", loss=val)
                if preemption.requested(device):
                    watchdog.arm(cfg.fault.grace_s)
                    save(done)
                    result.preempted = True
                    say(f"SIGTERM: saved step {done}, exiting")
                    break
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps:
                    save(done)
    finally:
        preemption.close()
        observer.close()
    result.final_step = sampler.step
    if logger:
        logger.close()
    return result
