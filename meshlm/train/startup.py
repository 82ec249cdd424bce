"""What a run checks and builds before its first step: the fail-fast checks of the config and the model
(no process group needed), the auto layout, `model.init_from` opened and checked, freezing and LoRA as the
strategies' Adapt transform takes them, the run directory's lock, and how often the step loop syncs with the host.

Trainer.__init__ (meshlm.train.trainer) runs these as its build steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshlm.checkpoint import CheckpointError
from meshlm.checkpoint.store import RunDirInUse, RunLock, StorageError, atomic_write, run_dir_problem, storage_cause
from meshlm.config import Config, ConfigError, to_toml
from meshlm.data import SFTData, TokenData, prepare_data_shared
from meshlm.data.dataset import check_tokenizer, document_separator
from meshlm.model import PRESETS, ModelConfig, Transformer, flops_per_token
from meshlm.model.llama import set_recompute
from meshlm.model.pretrained import HFWeights, init_tokenizer, is_hf_directory, keep_tokenizer
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.distributed import resolve_autocast
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import Layout, Mesh, parse_layout
from meshlm.parallel.options import PARALLEL_SECTION, TRAIN_SECTION, Loss, ParallelOptions
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.strategies import check_layout
from meshlm.parallel.transforms.lora import Adaptation
from meshlm.train.guards import DeviceStepGuard, Watchdog
from meshlm.train.optim import build_optimizer, skips_on_device
from meshlm.train.parts import BatchSource, TrainParts
from meshlm.train.prefetch import Prefetcher


def check_config(cfg: Config, world_size: int) -> tuple[Layout, int]:
    """Every layout check that needs no process group: fails fast, before data or model work."""
    layout = parse_layout(cfg.parallel.layout, world_size)
    train = cfg.train
    spec = LayoutSpec(
        cfg.model.build(), layout, train.global_batch, train.micro_batch, cfg.data.seq_len, cfg.parallel.options()
    )
    n_micro = check_layout(spec)  # sizes only: ParallelModel checks the model against its plan
    if cfg.train.freeze or cfg.lora.rank:
        with torch.device("meta"):
            adaptation(cfg).check(Transformer(cfg.model.build()))
    return layout, n_micro


def model_name(cfg: Config) -> str:
    """The start-up line's model: `model.init_from`, or the preset's name with the fields the run changes
    ('tiny resized: dim 128, n_layers 2'), so a resized preset is never reported as the preset itself."""
    if cfg.model.init_from:
        return cfg.model.init_from
    base = PRESETS[cfg.model.preset]
    changed = [f"{name} {value}" for name, value in cfg.model.build().to_dict().items() if getattr(base, name) != value]
    return f"{cfg.model.preset} resized: {', '.join(changed)}" if changed else cfg.model.preset


def another_model(path: Path, saved: dict, current: dict) -> CheckpointError:
    """A checkpoint whose model is not the config's: the first differing field, and the two ways on (a new run
    directory for the new model, or the checkpoint's value to resume it)."""
    name = next((k for k in current if saved.get(k) != current[k]), "?")
    return CheckpointError(
        f"checkpoint {path} is for another model (model.{name}: checkpoint {saved.get(name)!r}, config "
        f"{current.get(name)!r}); train the new model in a new run directory (--log.run_dir), or resume this one "
        f"with model.{name} = {saved.get(name)!r}"
    )


def adaptation(cfg: Config) -> Adaptation:
    """train.freeze and the [lora] section, as the Adapt transform applies them (meshlm.parallel.strategies)."""
    return Adaptation(tuple(cfg.train.freeze), cfg.lora, cfg.train.seed)


def check_user_layout(cfg: Config, world_size: int, model: nn.Module, parts: TrainParts) -> tuple[Layout, int]:
    """The same fail-fast checks for a model of the user's: the batch, the schedule and the pipeline chunks of
    its plan's layers (sizes only: ParallelModel checks the model against its plan)."""
    if cfg.parallel.layout == "auto":
        raise ConfigError("parallel.layout = 'auto' plans meshlm's own model shapes; give a layout for your model")
    layout = parse_layout(cfg.parallel.layout, world_size)
    plan = parts.plan or plan_for(model)
    adaptation(cfg).check(model, plan)
    n_layers = len(model.get_submodule(plan.pipeline.layers)) if plan.pipeline is not None else 1
    spec = LayoutSpec(None, layout, cfg.train.global_batch, cfg.train.micro_batch, 0, cfg.parallel.options(), n_layers)
    return layout, check_layout(spec)


def resolve_auto_layout(cfg: Config, world_size: int) -> Config:
    """`--parallel.layout auto`: the planner's fastest layout for this model, batch and world size."""
    if cfg.parallel.layout != "auto":
        return cfg
    from meshlm.plan import plan_for_config

    choice = plan_for_config(cfg, world_size)
    data = cfg.model_dump()
    data["train"]["recompute_layers"] = 0  # the planner's choice, named in the overrides only when > 0
    for key, value in choice.overrides().items():
        section, name = key.split(".")
        data[section][name] = value
    return Config.model_validate(data | {"model": cfg.model})  # the [model] section whole: init_from read once


def open_init_from(init_from: str, vocab_size: int, model: ModelConfig | None = None) -> HFWeights | None:
    """`model.init_from`'s HF weights (None for a meshlm checkpoint, which the trainer loads through its
    checkpointer) and tokenizer, checked (names, shapes, every listed shard present; the tokenizer loads, fits
    the vocabulary and has a document separator) on every rank before any work starts; a problem is one
    ConfigError or DataError line naming the file. `model`: the model init_from defines, where the caller has
    it (`cfg.model.build()`), so its config.json is not read again."""
    weights = None
    if is_hf_directory(init_from):
        try:
            weights = HFWeights(init_from, model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.init_from: {e}") from None
    tokenizer_file = init_tokenizer(init_from)
    if tokenizer_file is not None:
        document_separator(tokenizer_file, check_tokenizer(tokenizer_file, vocab_size))
    return weights


LORA_KEYS = (".lora_A", ".lora_B")


def take_run_lock(lock: RunLock) -> None:
    """Rank 0 takes the run directory's lock (one job per run directory) and tells the others: a directory in
    use stops every rank with rank 0's line."""
    verdict: list[Exception | None] = [None]
    if dist.get_rank() == 0:
        try:
            if taken_over := lock.acquire():
                print(taken_over, flush=True)
        except RunDirInUse as e:
            verdict = [e]
        except OSError as e:  # a file where the directory should be, a read-only mount
            verdict = [StorageError(run_dir_problem(lock.path.parent, e))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise verdict[0]


def with_absolute_cache(cfg: Config) -> Config:
    """`cfg` with data.cache_dir made absolute (against this process's working directory)."""
    cache = str(Path(cfg.data.cache_dir).expanduser().resolve())
    return (
        cfg
        if cache == cfg.data.cache_dir
        else cfg.model_copy(update={"data": cfg.data.model_copy(update={"cache_dir": cache})})
    )


def flat_config(cfg: Config) -> dict:
    """{'train.lr': 0.003, ...}: the config as an experiment tracker's parameters."""
    return {
        f"{section}.{name}": value for section, fields in cfg.model_dump().items() for name, value in fields.items()
    }


def resolve_sync(
    cfg: Config, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[int, DeviceStepGuard | None]:
    """(steps between host syncs, 0 = only where a log, eval or checkpoint needs one; the device guard or
    None). `train.sync_every = auto` syncs every step on CPU; on CUDA only where needed, when the optimizer
    can skip a vetoed update on the device (or the policy never skips). Past one step, an optimizer that
    can skips on the device; with another, a vetoed update is applied before it is read (rolled back or
    the run stops), so policy 'skip' is refused."""
    can_skip = skips_on_device(optimizer)
    every = cfg.train.sync_every
    if every == "auto":
        every = 0 if device.type == "cuda" and (can_skip or cfg.fault.nonfinite != "skip") else 1
    if every == 1:
        return 1, None
    if can_skip:
        return every, DeviceStepGuard(cfg.fault.spike_factor, device)
    if cfg.fault.nonfinite == "skip":
        raise ConfigError(
            f"train.sync_every = {every} with fault.nonfinite = 'skip' needs an optimizer that skips on the "
            "device (fused AdamW, meshlm's default); use 'rollback' or 'stop', or sync_every 1"
        )
    return every, None


# ---- build steps: what Trainer.__init__ runs, in order ------------------------------------------------------
def open_batches(
    cfg: Config,
    parts: TrainParts,
    device: torch.device,
    watchdog: Watchdog,
    given_tokenizer: Path | None,
    say: Callable[..., None],
) -> tuple[TokenData | SFTData | None, BatchSource]:
    """The batches in order, prefetched: the caller's source, or meshlm's data (returned too: tokenized once
    into the cache with `given_tokenizer`, or one trained from the corpus when None)."""
    data = None
    source = parts.batch_source()
    if source is None:
        watchdog.disarm()  # tokenizing the corpus is bounded by the barrier's own timeout
        say(f"data: {cfg.data.source} (token cache {cfg.data.cache_dir}; tokenized once, then reused)", flush=True)
        data = prepare_data_shared(cfg.data, cfg.model.build().vocab_size, given_tokenizer)
        watchdog.arm()
        source = data.sampler(cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
    return data, Prefetcher(source, cfg.train.steps, pin=device.type == "cuda")


def build_model(
    cfg: Config, parts: TrainParts, device: torch.device, model: nn.Module | None, init_source: HFWeights | None
) -> tuple[nn.Module, dict, float]:
    """The plain model to train (the caller's, or meshlm's built on the meta device, reading `model.init_from`'s
    weights as it materialises); its identity (what a checkpoint must match) and its
    training FLOPs per token."""
    if model is None:
        model_cfg = cfg.model.build()
        torch.manual_seed(cfg.train.seed)
        with torch.device("meta"):  # ParallelModel materialises only this rank's shard, seeded per element
            # model.init_from: each rank reads its shard from the checkpoint (init_source)
            model = Transformer(model_cfg, init_seed=cfg.train.seed, init_source=init_source)
        set_recompute(model, cfg.train.recompute, cfg.train.recompute_layers)
        identity = model_cfg.to_dict()
        flops_per_tok = flops_per_token(model_cfg, cfg.data.seq_len)
        if cfg.lora.rank:  # MFU of what a LoRA step computes: no weight gradients of the frozen base
            from meshlm.plan.step_time import lora_flops_per_token

            flops_per_tok = lora_flops_per_token(model_cfg, cfg.data.seq_len, cfg.lora.rank)
    else:
        n_params = sum(p.numel() for p in model.parameters())
        identity = {"class": type(model).__qualname__, "parameters": n_params}
        flops_per_tok = 6.0 * n_params  # forward + backward matmuls; attention scores not counted
    return model, identity, flops_per_tok


def engine_options(cfg: Config, device: torch.device, n_micro: int, compiled: bool) -> ParallelOptions:
    """The engine's options a run config sets: its `[parallel]` ones, train.fp8 and train.compile_backend, and
    those derived from it (meshlm.parallel.options.DERIVED): the micro-batches per replica, train.dtype's
    autocast on `device`, and whether the blocks are compiled (train.compile on `device`)."""
    return ParallelOptions(
        **cfg.parallel.model_dump(include=set(PARALLEL_SECTION)),
        **cfg.train.model_dump(include=set(TRAIN_SECTION)),
        micro_batches=n_micro,
        autocast_dtype=resolve_autocast(cfg.train.dtype, device),
        compile=compiled,
    )


def build_parallel_model(
    cfg: Config, parts: TrainParts, device: torch.device, model: nn.Module, mesh: Mesh, n_micro: int, compiled: bool
) -> ParallelModel:
    """This rank's part of `model` under the mesh's layout, through the library's own door
    (meshlm.parallel.engine.parallelize, which `meshlm.parallelize` is): frozen and LoRA-adapted first, FP8 and
    compiled blocks last, when asked (the transforms of meshlm.parallel.strategies). A model built on the
    device moves to the mesh's device there; a meta-built one is materialised on it."""
    loss = Loss(parts.loss_fn, cfg.train.ignore_index, parts.gather_logits, cfg.train.fused_loss)
    return parallelize(
        model,
        mesh,
        engine_options(cfg, device, n_micro, compiled),
        plan=parts.plan,
        loss=loss,
        lora=cfg.lora,
        freeze=cfg.train.freeze,
        lora_seed=cfg.train.seed,
    )


def build_run_optimizer(
    cfg: Config, parts: TrainParts, device: torch.device, model: ParallelModel
) -> torch.optim.Optimizer:
    """meshlm's AdamW (fused on CUDA, or where a vetoed update must be skipped on the device), or the caller's."""
    if parts.optimizer is None:
        skip_late = cfg.train.sync_every not in (1, "auto") and cfg.fault.nonfinite == "skip"
        return build_optimizer(model, cfg.train, fused=device.type == "cuda" or skip_late)
    return parts.optimizer(model.optimizer_param_groups(cfg.train.weight_decay))


def write_run_files(cfg: Config, run_dir: Path, data: TokenData | SFTData | None, given_tokenizer: Path | None) -> None:
    """Rank 0: config.toml and the tokenizer (exported with the weights by `meshlm convert`) in the run
    directory; a full disk or a read-only directory is one line naming the file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(run_dir / "config.toml", to_toml(cfg))  # a resume never reads half of it
        tokenizer = given_tokenizer
        if tokenizer is None and data is not None:
            tokenizer = data.directory / "tokenizer.json"
        if tokenizer is not None:
            keep_tokenizer(run_dir, tokenizer)
    except OSError as e:
        raise StorageError(f"run directory cannot be written: {storage_cause(e, run_dir)}") from None
