"""The shrunken replica of a run: the run's own config on at most `max_ranks` CPU ranks, small enough to train
for a few steps in seconds, keeping everything that can make a layout inexact.

The layout keeps every dimension that is > 1, at 2 (pp=4,dp=8,tp=8 -> pp=2,dp=2,tp=2), and with it the
schedule, virtual stages, ZeRO stage, sequence parallelism, cp attention, recompute, the micro-batches per
replica, LoRA, train.freeze and the [data] section. The model keeps its family and everything that changes its
function's form (GQA ratio and whether KV heads are split or replicated over tp, the head_dim rule, ties,
biases, norms, RoPE scaling, the MoE routing and which layers are MoE) and shrinks its sizes: each is searched
upward from a floor that keeps the structure, candidate by candidate through ModelConfig's own checks and
meshlm's layout checks for the mapped layout (meshlm.parallel.strategies.check_layout), whose rules are
never copied here. With `model.init_from`, the replica starts from a sliced copy of the checkpoint's real
weights (the first heads, rows, columns, experts and layers), written as an HF directory.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.config import Config
from meshlm.convert import load_checkpoint_model
from meshlm.data.dataset import check_tokenizer
from meshlm.data.tokenizer import MIN_VOCAB
from meshlm.errors import InputError
from meshlm.files import atomic_copy
from meshlm.model.config import ModelConfig
from meshlm.model.hf import hf_tensor_names
from meshlm.model.hf_export import export_hf
from meshlm.model.llama import Transformer
from meshlm.model.pretrained import TOKENIZER_FILES, HFWeights, init_tokenizer, is_hf_directory
from meshlm.parallel.contract import LayoutSpec
from meshlm.parallel.mesh import DIMS, Layout, parse_layout
from meshlm.parallel.strategies import check_layout
from meshlm.ties import unique_state_names
from meshlm.train.trainer import check_config, resolve_auto_layout

HEAD_DIM = 4  # the narrowest head with two rotary pairs (rotate-half pairs element i with i + head_dim / 2)
SEQ_LEN = 64  # tokens per sequence at most (fewer if the run has fewer)
SFT_SEQ_LEN = 256  # an SFT row: room for a whole prompt and part of its answer (labels in every row)
MICRO_ROWS = 2  # rows per micro-batch at most: two, so a row split inside a micro-batch still shows
ROOMY = 1 << 10  # a size every check of a mapped layout (dims of 2) accepts, for the fields not searched yet
SEARCH = 1 << 12  # candidates tried above a floor before a size is declared impossible


class ShrinkError(InputError):
    """A run that cannot be shrunk (its layout on the target world, or its model under the mapped layout's
    rules), in one line naming the constraint."""


@dataclass(frozen=True)
class Replica:
    config: Config  # runs on CPU at <= max_ranks ranks: the shrunk [model], the mapped layout, the rest the run's
    target_layout: str  # the run's layout as it will run ("auto" resolved by the planner for `world`)
    kept: tuple[str, ...]  # one human line each: what was kept ("GQA 8:1", "tied embeddings", ...)
    shrunk: tuple[str, ...]  # one human line each: "hidden 8192 -> 64", "pp=4,dp=8,tp=8 -> pp=2,dp=2,tp=2", ...


def shrink(config: Config, workdir: Path, *, world: int | None = None, max_ranks: int = 8) -> Replica:
    """The replica of run `config` for `world` ranks (the target GPU count; needed by layout 'auto', else the
    layout's product); a sliced copy of model.init_from goes under `workdir`. One-line ShrinkError on a run
    the target world cannot hold or a model that cannot shrink under the mapped layout's rules."""
    cfg, target, n_micro = _target(config, world)
    mapped = map_layout(target, max_ranks)
    same = str(target) == str(mapped)  # only what changed is listed as shrunk
    kept: list[str] = [f"layout {mapped}"] if same else []
    shrunk: list[str] = [] if same else [f"layout {target} -> {mapped}"]
    train = _train_section(cfg, target, mapped, n_micro, shrunk)
    original = cfg.model.build()
    vocab_floor = _vocab_floor(cfg, original)
    model, seq_len = shrink_model(original, cfg, target, mapped, train, vocab_floor)
    if cfg.train.recompute_layers:  # fewer than a chunk's blocks stays fewer (one of two), else all of them
        chunk, target_chunk = (
            model.n_layers // (mapped.pp * cfg.parallel.virtual_stages),
            original.n_layers // (target.pp * cfg.parallel.virtual_stages),
        )
        train["recompute_layers"] = 1 if cfg.train.recompute_layers < target_chunk else chunk
    kept += _model_kept(original, target)
    shrunk += _model_shrunk(original, model, cfg.data.seq_len, seq_len)
    data = cfg.model_dump()
    data["model"] = {"preset": cfg.model.preset, **model.to_dict()}
    if cfg.model.init_from is not None:
        data["model"] = {"init_from": str(slice_init_from(cfg, model, Path(workdir) / "init_from", shrunk))}
    data["data"]["seq_len"] = seq_len
    data["train"].update(train)
    data["parallel"]["layout"] = str(mapped)
    shard_size = cfg.parallel.zero_shard_size
    if shard_size is not None and shard_size > 2:  # the mapped replicas are 2 or 4 ranks: shard over 2 of them
        data["parallel"]["zero_shard_size"] = 2
        shrunk.append(f"ZeRO shard groups of {shard_size} -> 2 ranks")
    if cfg.lora.init_from is not None:
        data["lora"]["init_from"] = None
        shrunk.append(f"lora.init_from {cfg.lora.init_from} -> not sliced: adapters from their init rule")
    data["log"]["run_dir"] = str(Path(workdir) / "run")
    kept += _run_kept(cfg, target, n_micro)
    replica = _fit_lora_rank(Config.model_validate(data), mapped, shrunk)
    try:
        check_config(replica, mapped.world_size)
    except InputError as e:
        raise ShrinkError(f"the replica at {mapped} is refused: {e}") from None
    return Replica(replica, str(target), tuple(kept), tuple(shrunk))


def _fit_lora_rank(replica: Config, mapped: Layout, shrunk: list[str]) -> Config:
    """The replica with the largest LoRA rank up to the run's that its narrow targets hold (meshlm's own
    adaptation check decides), alpha scaled with it so that the update's scale alpha / rank stays the run's."""
    lora = replica.lora
    for rank in range(lora.rank, 0, -1):
        alpha = lora.alpha * rank / lora.rank
        candidate = replica.model_copy(update={"lora": lora.model_copy(update={"rank": rank, "alpha": alpha})})
        try:
            check_config(candidate, mapped.world_size)
        except InputError:
            continue
        if rank != lora.rank:
            shrunk.append(f"LoRA rank {lora.rank} -> {rank}, alpha {lora.alpha:g} -> {alpha:g} (the same alpha / rank)")
        return candidate
    return replica


def _target(config: Config, world: int | None) -> tuple[Config, Layout, int]:
    """The run as it will run: layout 'auto' resolved for `world`, the layout checked on `world` ranks (by
    default the layout's own product, dp 1 when unnamed); the micro-batches per replica."""
    if config.parallel.layout == "auto":
        if world is None:
            raise ShrinkError("parallel.layout = 'auto' needs the target world size (the number of GPUs the run uses)")
        config = resolve_auto_layout(config, world)
    text = config.parallel.layout
    if world is None:
        world = math.prod(int(v) for v in re.findall(r"=\s*(\d+)", text))
    try:
        layout = parse_layout(text, world)
        return config, layout, check_config(config, world)[1]
    except InputError as e:
        raise ShrinkError(f"the target run ({text or 'dp'} on {world} ranks): {e}") from None


def map_layout(target: Layout, max_ranks: int = 8) -> Layout:
    """Every dimension of `target` that is > 1 at 2, the others 1; a ShrinkError if that needs more than
    `max_ranks` ranks."""
    mapped = Layout(**{d: min(getattr(target, d), 2) for d in DIMS})
    if mapped.world_size > max_ranks:
        kept = [d for d in DIMS if getattr(target, d) > 1]
        raise ShrinkError(
            f"parallel.layout {target}: keeping its {len(kept)} dimensions > 1 ({', '.join(kept)}) at 2 needs "
            f"{mapped.world_size} CPU ranks, more than max_ranks={max_ranks}"
        )
    return mapped


def _train_section(cfg: Config, target: Layout, mapped: Layout, n_micro: int, shrunk: list[str]) -> dict[str, object]:
    """The [train] fields the replica changes: CPU fp32 eager, and the batch at the mapped data-parallel size
    with the run's micro-batches per replica, each of at most MICRO_ROWS rows."""
    train = cfg.train
    rows = min(train.micro_batch or train.global_batch // target.data_parallel, MICRO_ROWS)
    global_batch = rows * n_micro * mapped.data_parallel
    if global_batch != train.global_batch:
        shrunk.append(f"global batch {train.global_batch} -> {global_batch} ({rows} per micro-batch)")
    for field, value, text in (("device", "cpu", "cpu"), ("dtype", "fp32", "fp32"), ("compile", False, "off")):
        if getattr(train, field) != value:
            shrunk.append(f"{field} {getattr(train, field)} -> {text}")
    if train.fp8:
        shrunk.append("fp8 -> off (CPU)")
    return {
        "device": "cpu",
        "dtype": "fp32",
        "compile": False,
        "fp8": False,
        "global_batch": global_batch,
        "micro_batch": rows if train.micro_batch else 0,
    }


def _vocab_floor(cfg: Config, model: ModelConfig) -> int:
    """The fewest tokens the data path can use: the init_from tokenizer's (it is kept), else the byte-level
    BPE meshlm trains (meshlm.data.tokenizer), or the model's own if smaller."""
    tokenizer = init_tokenizer(cfg.model.init_from)
    if tokenizer is not None:
        return check_tokenizer(tokenizer, model.vocab_size).get_vocab_size(with_added_tokens=True)
    return min(MIN_VOCAB, model.vocab_size)


def _scaled(size: int, new_dim: int, dim: int) -> int:
    return max(1, math.ceil(size * new_dim / dim))


def shrink_model(
    model: ModelConfig, cfg: Config, target: Layout, mapped: Layout, train: dict[str, object], vocab_floor: int
) -> tuple[ModelConfig, int]:
    """The smallest model of `model`'s structure, and the shortest sequence, that the mapped layout accepts."""
    par = cfg.parallel
    refusal = [""]  # the last candidate's refusal, which names the constraint when no candidate fits

    def accepts(fields: dict[str, int], seq_len: int = ROOMY) -> bool:
        try:
            candidate = model.replace(**(roomy | fields))
            batch, micro = int(train["global_batch"]), int(train["micro_batch"])
            check_layout(LayoutSpec(candidate, mapped, batch, micro, seq_len, par.options()))
        except ValueError as e:  # ModelConfig's checks and the layout's (LayoutError is one)
            refusal[0] = str(e)
            return False
        return True

    def smallest(floor: int, make: Callable[[int], dict[str, int]], what: str, keep: Callable[[int], bool]) -> int:
        for value in range(floor, floor + SEARCH):
            if keep(value) and accepts({**found, **make(value)}):
                return value
        raise ShrinkError(f"no {what} from {floor} to {floor + SEARCH - 1} fits layout {mapped} ({refusal[0]})")

    ratio = model.n_heads // model.n_kv_heads
    head_dim = min(HEAD_DIM, model.head_dim)
    if model.head_dim_override:  # keep dim / n_heads on the same side of head_dim (Qwen3: below it)
        width = head_dim // 2 if model.dim // model.n_heads < model.head_dim else 2 * head_dim
    else:
        width = head_dim
    roomy = {
        "n_kv_heads": ROOMY, "n_heads": ROOMY * ratio, "dim": ROOMY * ratio * width, "intermediate_size": ROOMY,
        "vocab_size": ROOMY, "n_layers": max(ROOMY, model.n_layers),
        "head_dim_override": head_dim if model.head_dim_override else 0,
    }  # fmt: skip
    if model.n_experts:
        roomy |= {"n_experts": max(ROOMY, model.n_experts), "moe_intermediate_size": ROOMY}
        if model.shared_expert_intermediate_size:
            roomy["shared_expert_intermediate_size"] = ROOMY
    found: dict[str, int] = {}
    if not accepts(found):  # a refusal that no model size lifts: the batch or the schedule
        raise ShrinkError(f"the replica's layout {mapped}: {refusal[0]}")

    split = model.n_kv_heads % target.tp == 0  # KV heads split over tp (else replicated)
    kv = smallest(
        1,
        lambda k: {"n_kv_heads": k, "n_heads": k * ratio, "dim": k * ratio * width},
        "number of KV heads",
        lambda k: (k % mapped.tp == 0) if split else k < mapped.tp,
    )
    found |= {"n_kv_heads": kv, "n_heads": kv * ratio, "dim": kv * ratio * width}
    dim = found["dim"]
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if field in roomy:
            floor = _scaled(getattr(model, field), dim, model.dim)
            found[field] = smallest(floor, lambda n, f=field: {f: n}, f"model.{field}", lambda n: True)
    if model.n_experts:
        distinct = int(model.top_k < model.n_experts)  # routing chooses among more experts than it takes
        several = 2 if model.n_experts > target.ep else 1  # each ep rank keeps several experts
        floor = max(model.top_k + distinct, several * mapped.ep)
        found["n_experts"] = smallest(floor, lambda n: {"n_experts": n}, "model.n_experts", lambda n: True)
    found["vocab_size"] = smallest(vocab_floor, lambda n: {"vocab_size": n}, "model.vocab_size", lambda n: True)
    chunks, target_chunks = mapped.pp * par.virtual_stages, target.pp * par.virtual_stages
    even = model.n_layers % target_chunks == 0
    per_chunk = 2 if 0 < cfg.train.recompute_layers < model.n_layers // target_chunks else 1
    found["n_layers"] = smallest(
        max(2, chunks * per_chunk),
        lambda n: {"n_layers": n},
        "model.n_layers",
        lambda n: mapped.pp == 1 or (n % chunks == 0) == even,
    )
    seq_floor = min(SFT_SEQ_LEN if cfg.data.format == "sft" else SEQ_LEN, cfg.data.seq_len)
    for seq_len in range(seq_floor, seq_floor + SEARCH):
        if accepts(found, seq_len):
            return model.replace(**(roomy | found)), seq_len
    raise ShrinkError(f"no data.seq_len from {seq_floor} fits layout {mapped} ({refusal[0]})")


def _model_kept(model: ModelConfig, target: Layout) -> list[str]:
    """One line per structural property of the model that the replica keeps."""
    kept = [f"family {model.hf_model_type}", f"GQA {model.n_heads // model.n_kv_heads}:1"]
    if target.tp > 1:
        split = model.n_kv_heads % target.tp == 0
        kept.append(f"KV heads {'split over' if split else 'replicated across'} tp")
    kept.append("head_dim override (not dim / n_heads)" if model.head_dim_override else "head_dim = dim / n_heads")
    kept.append("tied embeddings" if model.tie_embeddings else "untied embeddings")
    flags = {
        "q/k/v biases": model.qkv_bias,
        "q/k norms": model.qk_norm,
        "llama3 RoPE scaling": model.rope_type == "llama3",
        f"sliding window {model.sliding_window}": model.sliding_window,
    }
    kept += [line for line, on in flags.items() if on]
    if model.n_experts:
        renormalised = ", top-k renormalised" if model.norm_topk else ""
        kept.append(f"MoE top-{model.top_k}, {model.moe_score} router{renormalised}")
        if model.shared_expert_intermediate_size:
            kept.append(f"shared expert{' (gated)' if model.shared_expert_gate else ''}")
        if model.first_k_dense or model.moe_layer_step > 1:
            kept.append(f"first {model.first_k_dense} layers dense, then MoE every {model.moe_layer_step}")
        if model.aux_loss_coef or model.z_loss_coef:
            kept.append(f"router losses aux {model.aux_loss_coef:g}, z {model.z_loss_coef:g}")
    return kept


def _model_shrunk(model: ModelConfig, small: ModelConfig, seq_len: int, new_seq_len: int) -> list[str]:
    """One line per size the replica shrinks."""
    sizes = {
        "hidden": "dim", "layers": "n_layers", "heads": "n_heads", "KV heads": "n_kv_heads",
        "head_dim": "head_dim", "intermediate": "intermediate_size", "vocab": "vocab_size",
        "experts": "n_experts", "expert intermediate": "moe_intermediate_size",
        "shared expert intermediate": "shared_expert_intermediate_size",
    }  # fmt: skip
    lines = [
        f"{name} {getattr(model, field)} -> {getattr(small, field)}"
        for name, field in sizes.items()
        if getattr(model, field) != getattr(small, field)
    ]
    return lines + ([f"seq_len {seq_len} -> {new_seq_len}"] if seq_len != new_seq_len else [])


def _run_kept(cfg: Config, target: Layout, n_micro: int) -> list[str]:
    """One line per feature of the run (layout, batch, adaptation, data) that the replica keeps."""
    par, train = cfg.parallel, cfg.train
    targets = ", ".join(cfg.lora.targets) or "the plan's"
    kept = []
    if target.pp > 1:
        kept.append(f"schedule {par.schedule}" + (f" x{par.virtual_stages}" if par.virtual_stages > 1 else ""))
    kept.append(f"{n_micro} micro-batch{'es' if n_micro > 1 else ''} per replica")
    flags = {
        f"ZeRO-{par.zero}": par.zero,
        "sequence parallel": par.sequence_parallel and target.tp > 1,
        f"cp attention {par.cp_attention}": target.cp > 1,
        f"recompute {train.recompute}": train.recompute != "none",
        f"recompute the first {train.recompute_layers} blocks of each chunk": train.recompute_layers,
        f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}, targets {targets}": cfg.lora.rank,
        f"frozen {', '.join(train.freeze)}": train.freeze,
        f"data {cfg.data.format} from {cfg.data.source}": True,
    }
    return kept + [line for line, on in flags.items() if on]


def _head_rows(heads: int, head_dim: int, new_head_dim: int) -> list[int]:
    """Rows of the first `heads` heads, each cut to `new_head_dim` keeping rotary pairs (rotate-half pairs
    element i with i + head_dim / 2): the first new_head_dim / 2 of each half."""
    half, new_half = head_dim // 2, new_head_dim // 2
    within = [*range(new_half), *range(half, half + new_half)]
    return [h * head_dim + i for h in range(heads) for i in within]


def slice_index(name: str, shape: tuple[int, ...], model: ModelConfig, small: ModelConfig) -> list[list[int] | int]:
    """For each dim of parameter `name` (of `shape`) of the `small` model: the indices it takes from the same
    parameter of `model`, as a list, or as a count of leading ones: the first heads (each cut keeping rotary
    pairs) along a head dimension, the first rows / columns / experts elsewhere."""
    q = _head_rows(small.n_heads, model.head_dim, small.head_dim)
    kv = _head_rows(small.n_kv_heads, model.head_dim, small.head_dim)
    one = _head_rows(1, model.head_dim, small.head_dim)
    heads = {  # (name suffix, dim) -> the rows of the heads it keeps
        ("q_proj.weight", 0): q, ("q_proj.bias", 0): q, ("o_proj.weight", 1): q,
        ("k_proj.weight", 0): kv, ("k_proj.bias", 0): kv, ("v_proj.weight", 0): kv, ("v_proj.bias", 0): kv,
        ("q_norm.weight", 0): one, ("k_norm.weight", 0): one,
    }  # fmt: skip
    return [
        next((rows for (suffix, d), rows in heads.items() if d == dim and name.endswith(suffix)), size)
        for dim, size in enumerate(shape)
    ]


Reader = Callable[[tuple[slice, ...]], torch.Tensor]


def take(read: Reader, shape: tuple[int, ...], index: list[list[int] | int]) -> torch.Tensor | None:
    """The part `index` (slice_index) of a stored tensor of `shape` that `read` reads by leading slices; None
    when the index reaches past the tensor (a size the replica grew)."""
    stops = [max(i) + 1 if isinstance(i, list) else i for i in index]
    if len(stops) != len(shape) or any(stop > size for stop, size in zip(stops, shape, strict=True)):
        return None
    tensor = read(tuple(slice(0, stop) for stop in stops))
    for dim, i in enumerate(index):
        if isinstance(i, list):
            tensor = tensor.index_select(dim, torch.tensor(i))
    return tensor


def _hf_reader(weights: HFWeights, name: str) -> Reader:
    """Reads meshlm parameter `name` of an HF checkpoint by leading slices (a stacked expert weight: from its
    experts' tensors)."""
    stored = hf_tensor_names(weights.cfg, weights.aliases.get(name, name))
    if len(stored) == 1:
        return lambda index: weights.read(stored[0], index)
    return lambda index: torch.stack([weights.read(stored[e], index[1:]) for e in range(index[0].stop)])


def slice_init_from(cfg: Config, small: ModelConfig, out: Path, shrunk: list[str]) -> Path:
    """Write the replica's initial weights, sliced from model.init_from (an HF directory or a meshlm run or
    checkpoint), as an HF directory `out` with the checkpoint's tokenizer files; a tensor that cannot be sliced
    keeps the model's init rule (named in `shrunk`). Returns `out`."""
    init_from = cfg.model.init_from
    original = cfg.model.build()
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Transformer(original).state_dict().items()}
    if is_hf_directory(init_from):
        weights = HFWeights(init_from)

        def reader(name: str) -> Reader:
            return _hf_reader(weights, name)
    else:
        state = load_checkpoint_model(Path(init_from))[0].state_dict()

        def reader(name: str) -> Reader:
            return lambda index: state[name][index]

    model = Transformer(small, init_seed=cfg.train.seed)  # the init rule, for what cannot be sliced
    params = model.state_dict()
    unsliced = []
    with torch.no_grad():
        for name in unique_state_names(model):
            part = None
            if name in shapes:
                part = take(reader(name), shapes[name], slice_index(name, tuple(params[name].shape), original, small))
            if part is None:
                unsliced.append(name)
            else:
                params[name].copy_(part)
    shutil.rmtree(out, ignore_errors=True)  # no tokenizer file of an earlier replica's init_from stays beside it
    try:
        export_hf(model, out)
    except ValueError as e:
        raise ShrinkError(f"model.init_from {init_from}: its sliced copy cannot be saved as HF weights ({e})") from None
    tokenizer = init_tokenizer(init_from)
    if tokenizer is not None:
        for file in TOKENIZER_FILES:
            if (tokenizer.parent / file).is_file():
                atomic_copy(tokenizer.parent / file, out / file)
    shrunk.append(f"init_from {init_from} -> its first heads, rows, columns, experts and layers in {out}")
    if unsliced:
        shown = ", ".join(unsliced[:3]) + (f" and {len(unsliced) - 3} more" if len(unsliced) > 3 else "")
        shrunk.append(f"not sliceable from init_from, so from the model's init rule: {shown}")
    return out
