"""The training loop: config in, checkpoints and metrics out. Parallelism enters only via ParallelModel.

`fit(cfg, model=..., loss_fn=..., data=..., optimizer=..., callbacks=...)` checks the layout, joins the
process group and runs a `Trainer` over the user's pieces or meshlm's built-in ones (meshlm.train.parts);
`train(cfg)` is `fit` with every built-in, what `meshlm train` runs. `Trainer.__init__` runs the build steps
(meshlm.train.startup: batches, model, parallel model, optimizer, checkpoints, run files, observers); its other
methods each own one concern: resume and rollback (sharded checkpoints, any layout), one step, what follows a
step (logging, fault guards, evaluation: meshlm.train.evaluation, callbacks) and saves. It drives the model
only through the public ParallelModel calls a custom loop uses too (forward_backward, clip_grad_norm_, step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshlm.checkpoint import (
    CheckpointError,
    CheckpointIO,
    init_optimizer_state,
    list_checkpoints,
    load_step_counts,
    meshlm_checkpoint,
    read_trainer_state,
    step_counts,
    training_entries,
    verify_checkpoint,
)
from meshlm.checkpoint.rng import Streams, reseeded_line, start_streams
from meshlm.checkpoint.store import RunLock
from meshlm.config import Config, ConfigError
from meshlm.data import TokenData
from meshlm.faults import fault_point
from meshlm.model.moe import moe_losses
from meshlm.model.pretrained import init_tokenizer
from meshlm.observe import StepObserver, aggregate
from meshlm.observe.env import environment
from meshlm.observe.metrics import MetricsLogger, TrainProgress, trackers
from meshlm.observe.profile import StepProfiler
from meshlm.parallel import distributed
from meshlm.parallel.distributed import env_rank, env_world_size, init_distributed, resolve_device
from meshlm.parallel.mesh import Layout, build_mesh
from meshlm.parallel.transforms.fp8 import check_fp8_device
from meshlm.train import signals
from meshlm.train.evaluation import evaluate, evaluate_batches
from meshlm.train.guards import Preemption, StepGuard, TrainingFault, Watchdog, check_replicas_in_sync
from meshlm.train.optim import device_train_step, lr_at, train_step
from meshlm.train.parts import BatchSource, Callback, TrainParts
from meshlm.train.replicas import ReplicaRun, group_config
from meshlm.train.startup import (
    LORA_KEYS,
    another_model,
    build_model,
    build_parallel_model,
    build_run_optimizer,
    check_config,
    check_user_layout,
    flat_config,
    model_name,
    open_batches,
    open_init_from,
    resolve_auto_layout,
    resolve_sync,
    take_run_lock,
    with_absolute_cache,
    write_run_files,
)

__all__ = ["BatchSource", "Callback", "TrainParts", "TrainResult", "Trainer", "fit", "train"]


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)  # steps after which weights were rolled back
    preempted: bool = False


def train(cfg: Config) -> TrainResult:
    """Train (or resume) meshlm's own model on `cfg.data` in `cfg.log.run_dir` (what `meshlm train` runs)."""
    return fit(cfg)


def fit(cfg: Config, parts: TrainParts | None = None, **pieces: object) -> TrainResult:
    """Train (or resume) the run in `cfg.log.run_dir` with the user's pieces (TrainParts fields as keyword
    arguments: model, loss_fn, data, eval_data, optimizer, callbacks, plan) or meshlm's built-ins; every
    checkpoint, guard, metric and restart feature of `meshlm train` applies. Returns this invocation's
    losses."""
    parts = parts or TrainParts(**pieces)
    owns_handler = signals.install()  # before any long start-up work (the CLI's is installed earlier still)
    try:
        return _fit(cfg, parts)
    except BaseException:
        if not signals.stopped_start_up():
            raise
        if env_rank() == 0:  # SIGTERM or SIGINT before the first step: start-up stopped where it was, nothing to save
            print(signals.before_start_line(), flush=True)
        return TrainResult(run_dir=Path(cfg.log.run_dir), preempted=True)
    finally:
        signals.finish_run(release=owns_handler)


def _fit(cfg: Config, parts: TrainParts) -> TrainResult:
    world_size = env_world_size()
    if cfg.fault.replica_groups > 1:  # this launch is one of the job's replica groups: its batch, its run dir
        cfg = group_config(cfg)
    model = parts.build_model(cfg.train.seed)
    if model is None:
        cfg = resolve_auto_layout(cfg, world_size)
        layout, n_micro = check_config(cfg, world_size)
    else:
        layout, n_micro = check_user_layout(cfg, world_size, model, parts)
    device = resolve_device(cfg.train.device)
    if cfg.train.fp8 is True:  # 'emulate' runs anywhere
        check_fp8_device(device)
    # Armed before the process group exists: a restarted rank can hang in rendezvous or set-up too.
    watchdog = Watchdog(Path(cfg.log.run_dir), env_rank(), cfg.fault.watchdog_s)
    watchdog.arm()
    created_group = succeeded = False
    trainer = None
    lock = RunLock(Path(cfg.log.run_dir))
    try:
        created_group = init_distributed(device, cfg.parallel.timeout_s)
        take_run_lock(lock)
        trainer = Trainer(cfg, layout, n_micro, device, watchdog, parts, model)
        result = trainer.run()
        succeeded = True
        return result
    finally:
        if trainer is not None:
            trainer.close()
        lock.release()
        watchdog.close()
        del trainer  # and with it its groups (the model's, the checkpoints'), so their gloo threads are joined
        if created_group:  # on every rank's success; a failed rank's peers may be gone (no barrier)
            distributed.end_process_group() if succeeded else dist.destroy_process_group()


# The sampler's state that fixes the batch stream, and the config field each comes from
_STREAM_FIELDS = {"global_batch": "train.global_batch", "seed": "train.seed", "seq_len": "data.seq_len"}


def _data_mismatch(saved: dict, current: dict) -> str | None:
    """How a checkpoint's batch stream differs from this run's, naming the config field, or None: resuming
    with another batch, seed, sequence length or corpus would silently train on another stream."""
    for key, name in _STREAM_FIELDS.items():
        if key in saved and key in current and saved[key] != current[key]:
            return f"with {name} = {saved[key]}, this run has {current[key]}: resume with the run's own config.toml"
    if "n_tokens" in saved and "n_tokens" in current and saved["n_tokens"] != current["n_tokens"]:
        return (
            f"on {saved['n_tokens']} training tokens, this run's data has {current['n_tokens']} (data.source, "
            f"data.max_chars, data.val_fraction or the tokenizer changed): resume with the run's own config.toml"
        )
    return None


class Trainer:
    """One rank's training run; every public method is collective (all ranks call it together)."""

    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        n_micro: int,
        device: torch.device,
        watchdog: Watchdog,
        parts: TrainParts | None = None,
        model: nn.Module | None = None,
    ) -> None:
        """The run's build steps (meshlm.train.startup), in order: batches, model, parallel model, optimizer,
        checkpoints (fine-tuned or resumed from), run files, observers and guards."""
        cfg = with_absolute_cache(cfg)  # saved in config.toml: `meshlm eval/generate RUN` from anywhere reuses it
        self.cfg, self.layout, self.device, self.watchdog = cfg, layout, device, watchdog
        self.parts = parts = parts or TrainParts()
        self.callbacks: list[Callback] = list(parts.callbacks)
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.log.run_dir)
        self.say = print if self.rank == 0 else (lambda *_, **__: None)
        init_from = cfg.model.init_from if model is None else None  # fine-tuning meshlm's own model
        model_cfg = cfg.model.build()  # init_from's model, read once (meshlm.config.ModelSection.build)
        init_source = open_init_from(init_from, model_cfg.vocab_size, model_cfg) if init_from else None
        given_tokenizer = init_tokenizer(cfg.model.init_from)  # None: trained from the corpus
        self.data, self.sampler = open_batches(cfg, parts, device, watchdog, given_tokenizer, self.say)
        model, self.model_identity, flops_per_tok = build_model(cfg, parts, device, model, init_source)
        self.compiled = cfg.train.compile is True or (cfg.train.compile == "auto" and device.type == "cuda")
        self.mesh = build_mesh(layout, device.type)
        self.model = build_parallel_model(cfg, parts, device, model, self.mesh, n_micro, self.compiled)
        shapes = self.model.global_shapes  # the whole model's counts, LoRA adapters included, trainable or not
        self.param_counts = (sum(s.numel() for s in shapes.values()),
                             sum(shapes[name].numel() for name in self.model.trainable))  # fmt: skip
        self.dp_rank, self.dp = self.mesh.rank("batch"), layout.data_parallel  # ep ranks get rows of their own
        self.optimizer = build_run_optimizer(cfg, parts, device, self.model)
        self.sync_every, self.device_guard = resolve_sync(cfg, self.optimizer, device)
        init_optimizer_state(self.optimizer)  # so checkpoints and rollbacks can fill it in place
        self.checkpointer = self.open_checkpointer()
        self.result = TrainResult(run_dir=self.run_dir)
        self.streams: Streams | None = None  # a resume's random streams, set right before its first step
        if init_from and init_source is None:
            self.load_weights(init_from)
        self.replicas = ReplicaRun(cfg, self) if cfg.fault.replica_groups > 1 else None
        self.resume()
        self.logger = self.open_logs(given_tokenizer)
        self.start_observers(flops_per_tok)
        self.preemption = Preemption()
        self.guard = StepGuard(cfg.fault.nonfinite, cfg.fault.spike_factor)
        self.check_desync = cfg.fault.desync_every and layout.dp > 1 and cfg.parallel.zero < 3
        # Steps since the last host sync: (step, loss, grad norm, lr, applied); under train.sync_every != 1
        # loss and norm are device tensors and `applied` the device guard's verdict (None without it).
        self.pending: list[tuple[int, object, object, float, bool | None]] = []
        self.vetoed_run, self.save_deferred = 0, False  # updates vetoed in a row; a due save waits for a sound one

    def open_checkpointer(self) -> CheckpointIO:
        cfg = self.cfg
        return CheckpointIO(
            self.run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, cfg.parallel.timeout_s,
            on_shard_written=lambda step: fault_point("save", self.rank, step), say=self.say,
            record=lambda step, outcome: self.log(step, "checkpoint", **outcome),
        )  # fmt: skip

    def open_logs(self, given_tokenizer: Path | None) -> MetricsLogger | None:
        """Rank 0: the run files (config.toml, the tokenizer) and the metrics logger; None on the others."""
        cfg = self.cfg
        if self.rank != 0:
            return None
        write_run_files(cfg, self.run_dir, self.data, given_tokenizer)
        sinks = trackers(self.run_dir, cfg.log.wandb_project, cfg.log.mlflow_experiment, flat_config(cfg))
        return MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard, start_step=self.sampler.step, sinks=sinks)

    def start_observers(self, flops_per_tok: float) -> None:
        """Step timing and MFU, the profiler, the environment's log line and the start-up summary."""
        cfg, device = self.cfg, self.device
        tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        dist.barrier()  # ranks sharing a CPU measure its matmul peak together
        self.observer = StepObserver(
            flops_per_tok * tokens_per_step, tokens_per_step,
            n_devices=dist.get_world_size(), device=device, peak_flops=cfg.log.peak_flops or None,
            model=self.model, optimizer=self.optimizer, activations=cfg.log.activation_memory,
        )  # fmt: skip
        self.profiler = StepProfiler(cfg.log.profile_steps, self.run_dir / "profile", self.rank, device)
        self.log(
            self.sampler.step, "env", **environment(device, str(self.layout)), peak_flops=self.observer.peak_flops,
            mfu_of=self.observer.mfu_basis,
        )  # fmt: skip
        self.say(self.startup_summary(flops_per_tok), flush=True)

    def startup_summary(self, flops_per_tok: float) -> str:
        """What this run is, in a few plain lines for an operator's log: model, layout, batch, data,
        checkpoints, and where it starts."""
        cfg, (total, trainable) = self.cfg, self.param_counts
        model = self.model_identity.get("class") or model_name(cfg)
        tokens = cfg.train.global_batch * cfg.data.seq_len
        recompute = cfg.train.recompute + (f" (+ {k} blocks full)" if (k := cfg.train.recompute_layers) else "")
        dtype = "bf16 autocast" if self.model.autocast_dtype is not None else "fp32"
        start = (f"resumed from {self.resumed_from} at step {self.sampler.step}" if self.resumed_from
                 else "fresh start at step 0")  # fmt: skip
        every = f"every {cfg.checkpoint.every} steps" if cfg.checkpoint.every else "at the end only"
        return "\n".join([
            f"model: {model}, {flops_per_tok * tokens / 1e12:.3g} TFLOP/step; parameters: {total:,} total, "
            f"{trainable:,} trainable",
            f"layout: {self.layout} on {dist.get_world_size()} ranks ({self.device.type}), zero "
            f"{cfg.parallel.zero}, schedule {cfg.parallel.schedule}, recompute {recompute}, dtype {dtype}, "
            f"compile {'on' if self.compiled else 'off'}, fused loss {'on' if cfg.train.fused_loss else 'off'}",
            f"batch: {cfg.train.global_batch} × {cfg.data.seq_len} tokens = {tokens:,} tokens/step, micro-batch "
            f"{cfg.train.micro_batch or 'whole'}, {cfg.train.steps} steps",
            f"corpus: {self.corpus_size()}",
            f"checkpoints: {self.run_dir} {every}; {start}",
        ])  # fmt: skip

    def corpus_size(self) -> str:
        if self.data is None:
            return "batches from the caller's source"
        if isinstance(self.data, TokenData):
            return f"{len(self.data.train):,} train and {len(self.data.val):,} validation tokens"
        return f"{len(self.data.train):,} train and {len(self.data.val):,} validation examples"

    def log(self, step: int, kind: str, **values: object) -> None:
        if self.logger is not None:
            self.logger.log(step, kind, **values)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def newest_checkpoint(self) -> Path | None:
        """Rank 0 verifies (moving corrupt ones aside, named) and tells the others."""
        return self.checkpointer.newest_valid()

    def resume(self) -> None:
        """Leftovers of failed saves removed, corrupt checkpoints moved aside, then the newest valid one."""
        path = self.checkpointer.resume_point(self.cfg.checkpoint.resume, self.cfg.checkpoint.allow_fresh_start)
        self.resumed_from, saved = path, None
        if path is not None:
            saved = self.load(path, restore_data_position=True)
            self.say(f"resuming from {path} at step {self.sampler.step} (saved under {saved.get('layout')})")
            if self.streams is None:
                self.say(reseeded_line(saved.get("world_size"), dist.get_world_size(), self.sampler.step))
            if self.sampler.step >= (steps := self.cfg.train.steps):  # a finished run restarted, or steps lowered
                self.say(f"run already at step {self.sampler.step} >= train.steps {steps}: nothing to do")
            elif (was := saved.get("lr_schedule")) and was != self.lr_schedule():
                changed = ", ".join(f"train.{k} {v} (was {was.get(k)})" for k, v in self.lr_schedule().items()
                                    if was.get(k) != v)  # fmt: skip
                self.say(f"warning: {changed}: the learning-rate schedule is reshaped from step {self.sampler.step} "
                         "on (resume with the checkpoint's values to keep it)")  # fmt: skip
        if self.replicas is not None:  # before the first quorum: no live peer means resume from disk
            self.replicas.resumed(saved)
        self.result.start_step = self.result.final_step = self.sampler.step

    def lr_schedule(self) -> dict[str, float]:
        """The fields `lr_at` reads: a resume with others reshapes the schedule of the steps still to run."""
        train = self.cfg.train
        return {"steps": train.steps, "warmup_steps": train.warmup_steps, "lr": train.lr,
                "min_lr_ratio": train.min_lr_ratio}  # fmt: skip

    def load_weights(self, init_from: str) -> None:
        """`model.init_from` a meshlm run or checkpoint: its weights only (rank 0 verifies it), resharded to this
        layout; the optimizer and the data position start afresh."""
        path = meshlm_checkpoint(init_from)
        problem = [None]
        if self.rank == 0:
            try:
                verify_checkpoint(path)
            except CheckpointError as e:
                problem = [f"model.init_from: {e}"]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise CheckpointError(problem[0])
        entries = training_entries(self.model, frozen=True)
        entries = {key: chunks for key, chunks in entries.items() if not key.endswith(LORA_KEYS)}  # not in a base
        self.checkpointer.load(path, entries)
        self.model.after_load()
        self.say(f"fine-tuning from {path}")

    def load(self, path: Path, restore_data_position: bool) -> dict:
        """Weights and Adam state from `path`, resharded to this layout; the data position too if asked."""
        saved = read_trainer_state(path)
        current = json.loads(json.dumps(self.model_identity))
        if saved.get("model") != current:
            raise another_model(path, saved["model"], current)
        streams = self.checkpointer.load(path, training_entries(self.model, self.optimizer), restore_streams=False)
        load_step_counts(self.model, self.optimizer, saved)
        self.model.after_load()
        if restore_data_position:
            if problem := _data_mismatch(saved["sampler"], self.sampler.state_dict()):
                raise CheckpointError(f"checkpoint {path} was saved {problem}")
            self.sampler.load_state_dict(saved["sampler"])
            self.streams = streams  # a rollback keeps the streams running, as it keeps the data position
        return saved

    def save_if_sound(self, step: int) -> bool:
        """Save unless the newest update was vetoed: weights that just failed a step (a non-finite gradient,
        a spike) are not known to be sound, so the save waits for the next applied update and the newest
        checkpoint stays the resume point. Returns whether it saved."""
        if self.vetoed_run:
            if not self.save_deferred:
                self.progress.print(f"step {step}: checkpoint deferred to the next applied update (vetoed)")
            self.save_deferred = True
            return False
        self.save_deferred = False
        self.save(step)
        return True

    def newest_line(self) -> str:
        found = list_checkpoints(self.run_dir)
        return f"the newest checkpoint is {found[-1]}" if found else "no checkpoint was written"

    def save(self, step: int) -> None:
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            **step_counts(self.model, self.optimizer),
            "layout": str(self.layout),
            "world_size": dist.get_world_size(),
            "model": self.model_identity,
            "lr_schedule": self.lr_schedule(),
        }
        if self.replicas is not None:
            state["replica_groups"] = self.replicas.checkpoint_state()
        self.checkpointer.save(step, training_entries(self.model, self.optimizer, writer=True), state)
        for callback in self.callbacks:
            callback.on_checkpoint(self, step)

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg = self.cfg
        with TrainProgress(cfg.train.steps, self.sampler.step, enabled=cfg.log.progress, rank0=self.rank == 0,
                           every=cfg.log.every) as bar:  # fmt: skip
            self.progress = bar
            self.watchdog.arm()
            start_streams(self.streams, cfg.train.seed, self.sampler.step)  # after all start-up draws
            if self.result.start_step == 0 and cfg.train.eval_every:
                self.evaluate(0)
            while self.sampler.step < cfg.train.steps:
                done = self.step()
                if done is None or not self.syncs_at(done):  # None: not committed by the replica groups
                    continue
                self.checkpointer.poll(self.device)  # a failed background save stops the run here
                if self.preemption.requested(self.device):
                    self.watchdog.arm(cfg.fault.grace_s)
                    saved = self.save_if_sound(done)
                    self.checkpointer.wait()  # a background save in flight completes too
                    self.result.preempted = True
                    self.say(
                        f"{signals.signal_name()}: "
                        + (
                            f"saved step {done}, exiting"
                            if saved
                            else f"step {done} not saved (its update was vetoed), exiting; {self.newest_line()}"
                        )
                    )
                    break
                due = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps
                if due or self.save_deferred:
                    self.save_if_sound(done)
        self.checkpointer.wait()
        if self.save_deferred:
            self.say(f"final checkpoint not written: the last {self.vetoed_run} update(s) were vetoed; "
                     f"{self.newest_line()}")  # fmt: skip
        self.result.final_step = self.sampler.step
        return self.result

    def syncs_at(self, done: int) -> bool:
        """Whether step `done` reads its numbers on the host: every `train.sync_every` steps, the first and
        last, and wherever a log, evaluation, checkpoint or replica check is due (they need settled steps).
        Only there are the steps' guard verdicts recorded, SIGTERM and background saves checked."""
        c = self.cfg
        every = (self.sync_every, c.log.every, c.log.aggregate_every, c.train.eval_every, c.checkpoint.every)
        every += (c.fault.desync_every,) if self.check_desync else ()
        return done in (1, c.train.steps) or any(k and done % k == 0 for k in every)

    def check_batch_rows(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The data's rows per replica agree with train.global_batch (which sets tokens/s, MFU and the
        schedule), and its targets with its inputs: one line before the first step otherwise."""
        rows, want = inputs.shape[0], self.cfg.train.global_batch // self.dp
        if rows != want:
            raise ConfigError(
                f"train.global_batch = {self.cfg.train.global_batch}, but the data gave this dp rank {rows} rows "
                f"(× dp={self.dp} = {rows * self.dp}); set train.global_batch = {rows * self.dp} or give global "
                f"batches of {self.cfg.train.global_batch} rows"
            )
        if targets.shape != inputs.shape[:2]:
            raise ConfigError(
                f"data: targets of shape {tuple(targets.shape)} do not match inputs {tuple(inputs.shape)}; "
                "each batch is (inputs, targets) with one target id per input token"
            )

    def step(self) -> int | None:
        """One optimizer step and, at a sync step, everything that follows it; returns the steps done (None: a
        replica group failed it, redone after the next quorum)."""
        if self.replicas is not None:
            self.replicas.start_step()  # the quorum: may heal this group from a peer (weights, step, data)
        step = self.sampler.step
        done = step + 1
        sync = self.syncs_at(done)
        self.profiler.before_step(done)
        self.observer.start_step()
        with self.observer.data_wait():
            if self.replicas is not None:
                inputs, targets = self.replicas.batch(self.dp_rank, self.dp)
            else:
                inputs, targets = self.sampler.next_batch(self.dp_rank, self.dp)
        if done == self.result.start_step + 1:
            self.check_batch_rows(inputs, targets)
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        lr = lr_at(step, self.cfg.train)
        args = (self.model, self.optimizer, inputs, targets, lr, self.cfg.train.grad_clip)
        if self.sync_every == 1:  # read at once, so a bad update is vetoed before it is applied
            loss, grad_norm, applied = train_step(*args, self.guard.allow, self.replicas and self.replicas.commit)
            if applied is None:
                self.observer.end_step(close=False)
                return None
            self.pending.append((done, loss, grad_norm, lr, applied))
        else:  # vetoed on the device, or (without a device guard) guarded late
            veto = self.device_guard.allow if self.device_guard is not None else None
            loss, grad_norm, applied = device_train_step(*args, veto)
            self.pending.append((done, loss, grad_norm, lr, applied))
        metrics = self.observer.end_step(close=sync)
        self.watchdog.arm()
        fault_point("step", self.rank, done)
        if trace := self.profiler.after_step(done):
            self.progress.print(f"profiler trace: {trace}")
        if sync:
            settled = self.settle(metrics)
            self.periodic_checks(done, metrics)
            for settled_step, loss in settled:
                for callback in self.callbacks:
                    callback.on_step_end(self, settled_step, loss, metrics)
        return done

    def settle(self, metrics: dict) -> list[tuple[int, float]]:
        """The steps since the last sync, in order: their losses, norms and device verdicts read (one host
        sync for all of them), recorded (without a device guard, guarded now: a rejected step is already
        applied, so it is rolled back or the run stops) and logged with this window's metrics. Returns
        (step, loss) of each."""
        pending, self.pending = self.pending, []
        unread = [
            torch.stack((loss.float(), norm.float(), (norm.new_ones(()) if ok is None else ok).float()))
            for _, loss, norm, _, ok in pending
            if not isinstance(ok, bool)
        ]
        read = iter(torch.stack(unread).tolist() if unread else [])
        settled, rolled_back = [], False
        for done, loss, grad_norm, lr, applied in pending:
            if applied is None:
                loss, grad_norm, _ = next(read)
                applied = rolled_back or self.guard.allow(loss, grad_norm)
            elif not isinstance(applied, bool):
                loss, grad_norm, verdict = next(read)
                applied = self.guard.decided(loss, grad_norm, verdict == 1.0) or rolled_back
            self.result.losses.append(loss)
            if applied:
                self.vetoed_run = 0
            else:
                late = self.sync_every != 1 and self.device_guard is None
                rolled_back = self.rejected(done, loss, grad_norm, already_applied=late)
            if done % self.cfg.log.every == 0 or done == self.cfg.train.steps or done == 1:
                self.log(done, "train", loss=loss, grad_norm=grad_norm, lr=lr, **metrics, **self.moe_metrics())
            settled.append((done, loss))
        self.progress.update(done, loss, metrics["tokens_per_s"], extra=self.observer.mfu_label(metrics["mfu"]))
        return settled

    def moe_metrics(self) -> dict[str, float]:
        """The MoE auxiliary losses of this rank's last micro-batch, averaged over its MoE layers (none without)."""
        per_chunk = [moe_losses(chunk) for chunk in self.model.chunks]
        found = [values for values in per_chunk if values]
        return {key: sum(v[key].item() for v in found) / len(found) for key in found[0]} if found else {}

    def rejected(self, done: int, loss: float, grad_norm: float, already_applied: bool = False) -> bool:
        """A vetoed update: skipped, or (policy 'rollback') weights and Adam state back to the newest
        checkpoint while the data position stays, so the batches since are not seen again. An update
        `already_applied` (train.sync_every > 1 without a device guard) cannot be skipped: without a
        checkpoint the run stops. Returns whether it rolled back."""
        self.result.skipped_steps.append(done)
        self.vetoed_run += 1
        action = "skipped"
        if self.cfg.fault.nonfinite == "rollback":
            self.checkpointer.wait()
            path = self.newest_checkpoint()
            if path is None and already_applied:
                raise TrainingFault(
                    f"stopping: {self.guard.last_reason} at step {done}, applied before it was read "
                    f"(train.sync_every = {self.sync_every}) and no checkpoint to roll back to yet"
                )
            if path is None:
                action = "skipped (no checkpoint to roll back to yet)"
            elif len(self.result.rollbacks) >= self.cfg.fault.max_rollbacks:
                raise TrainingFault(
                    f"stopping: {self.guard.last_reason} after {len(self.result.rollbacks)} rollbacks "
                    f"(fault.max_rollbacks = {self.cfg.fault.max_rollbacks})"
                )
            else:
                self.load(path, restore_data_position=False)
                self.result.rollbacks.append(done)
                self.vetoed_run = 0  # the checkpoint's weights are sound
                action = f"rolled back to {path.name}"
        if self.vetoed_run >= self.cfg.fault.max_skips:
            self.checkpointer.wait()  # a save in flight is of a sound state: it commits
            raise TrainingFault(
                f"stopping at step {done}: {self.vetoed_run} updates in a row vetoed (fault.max_skips = "
                f"{self.cfg.fault.max_skips}), the last for {self.guard.last_reason}; {self.newest_line()}"
            )
        self.progress.print(f"step {done}: update {action}: {self.guard.last_reason}")
        self.log(done, "fault", skipped=1, action=action, loss=loss, grad_norm=grad_norm, reason=self.guard.last_reason)
        return action.startswith("rolled back")

    def periodic_checks(self, done: int, metrics: dict) -> None:
        """Straggler summary, replica desync check and evaluation, each on its own interval."""
        cfg = self.cfg
        last = done == cfg.train.steps
        if cfg.log.aggregate_every and (done % cfg.log.aggregate_every == 0 or last):
            summary = aggregate(metrics, cfg.log.straggler_threshold)
            self.log(done, "ranks", **summary)
            if summary.get("straggler_rank", -1) >= 0:
                self.progress.print(
                    f"step {done}: rank {summary['straggler_rank']:.0f} is a straggler "
                    f"({summary['straggler_ratio']:.2f}× the median compute time)"
                )
        if self.check_desync and done % cfg.fault.desync_every == 0:
            check_replicas_in_sync(self.model)
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or last):
            self.evaluate(done)

    def evaluate(self, done: int) -> None:
        if self.replicas is not None:  # every replica group evaluates the same batches, by itself
            with self.replicas.alone():
                return self.evaluate_group(done)
        return self.evaluate_group(done)

    def evaluate_group(self, done: int) -> None:
        if self.data is not None:
            val = evaluate(self.model, self.data, self.cfg, self.dp_rank, self.dp)
        elif self.parts.eval_data is not None:
            val = evaluate_batches(self.model, self.parts.eval_batches())
        else:
            return
        for callback in self.callbacks:
            callback.on_eval(self, done, val)
        self.result.eval_losses.append((done, val))
        if done:
            self.progress.print(f"step {done}: train loss {self.result.losses[-1]:.4f}, val loss {val:.4f}")
        self.log(done, "eval", loss=val)

    def close(self) -> None:
        """Release observers and logs (the SIGTERM handler stays: meshlm.train.signals). A save still in
        flight here means the run failed: it is abandoned (its staging folder is never committed), the previous
        checkpoint stays valid."""
        self.result.final_step = self.sampler.step
        fault_point("close", self.rank, self.result.final_step)
        for part in ("preemption", "observer", "logger", "sampler", "replicas"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
