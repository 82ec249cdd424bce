"""Frozen weights and LoRA adapters (Hu et al. 2021) on any model with a parallel plan.

`apply_lora(model, rank, alpha, targets)` turns each target `nn.Linear` into a `LoRALinear`: the same weight
and bias (same parameter names) plus `lora_A` (rank × in) and `lora_B` (out × rank), computing

    y = x Wᵀ + b + (dropout(x) Aᵀ) Bᵀ · alpha / rank

and freezes every other parameter (`requires_grad = False`). `Adaptation` is what the strategy list's first
transform (Adapt, meshlm.parallel.strategies) applies for `meshlm train` and `meshlm.parallelize(lora=...)`;
`apply_lora` by hand goes before `meshlm.parallelize`. Either way the strategies then see only what trains. Data
parallel / ZeRO packs, reduces and shards only trainable parameters (the frozen base gets no gradient buffer, no
reduction and no optimizer state); tensor parallel shards each adapter with its base
(meshlm.parallel.tp.sharding): a column-parallel base gets a replicated A and a row-sharded B, a row-parallel
base a column-sharded A and a replicated B whose partial output joins the base's partial sum in its one all-reduce;
pipeline and context parallel need nothing.

A is drawn like PEFT's (Kaiming-uniform, bound 1/√in) from a generator seeded by `seed`, on the CPU, so
every rank and the single-process model start from the same adapters even when the base is built on the
`meta` device; B starts at zero, so the adapted model starts as the base.

Adapters leave as PEFT directories (`export_peft`: adapter_config.json + adapter_model.safetensors) or merged
into the base (`merged_state_dict`: W + B·A·alpha/rank), and come back with `load_adapter`.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from meshlm.files import atomic_write
from meshlm.model.lora import LoRAError, LoRALinear, LoRASpec, lora_spec
from meshlm.parallel.options import LoRAOptions

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_PARAMS = ("lora_A", "lora_B")
LORA_STYLES = ("colwise", "colwise_heads", "rowwise")  # the plan's attention and MLP projections, not the head


def default_targets(model: nn.Module, plan: object | None = None) -> list[str]:
    """The plan's tensor-parallel patterns of attention and MLP projections (colwise and rowwise styles)."""
    from meshlm.parallel.plan_registry import plan_for

    plan = plan or plan_for(model)
    return [pattern for pattern, style in plan.tensor_parallel.items() if style in LORA_STYLES]


def freeze_patterns_match(model: nn.Module, patterns: Iterable[str], field: str = "train.freeze") -> list[str]:
    """The parameter names the fnmatch patterns match; a pattern matching none is a one-line LoRAError."""
    names = [n for n, _ in model.named_parameters()]
    matched = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise LoRAError(f"{field}: pattern {pattern!r} matches no parameter (e.g. {', '.join(names[:3])})")
        matched += hits
    return sorted(set(matched))


def freeze(model: nn.Module, patterns: Iterable[str], field: str = "train.freeze") -> list[str]:
    """requires_grad = False on every parameter whose name matches one of the fnmatch patterns; a pattern
    matching none is a one-line error. Returns the frozen names."""
    frozen = freeze_patterns_match(model, patterns, field)
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: Iterable[str] | None = None,
    plan: object | None = None,
    seed: int = 0,
) -> list[str]:
    """Adapt the Linear modules matching `targets` (fnmatch patterns of module names; default: the plan's
    attention and MLP projections) in place and freeze the rest of the model. `alpha` defaults to `rank`
    (scaling 1). Returns the adapted module names. Bad input is a one-line LoRAError."""
    chosen = lora_targets(model, rank, alpha, dropout, targets, plan)
    spec = LoRASpec(rank, float(rank if alpha is None else alpha), dropout)
    linears = dict(model.named_modules())
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRALinear(linears[name], spec, generator))
    return chosen


def lora_targets(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: Iterable[str] | None = None,
    plan: object | None = None,
) -> list[str]:
    """The Linear modules `apply_lora` would adapt, in registration order, after checking every argument
    (cheap on a meta model: nothing is allocated). One-line LoRAError on bad input."""
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"lora.rank must be a positive integer, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    if alpha <= 0:
        raise LoRAError(f"lora.alpha must be positive, got {alpha}")
    if not 0 <= dropout < 1:
        raise LoRAError(f"lora.dropout must be in [0, 1), got {dropout}")
    targets = list(targets) if targets else default_targets(model, plan)
    if not targets:
        raise LoRAError(
            f"lora.targets: {type(model).__name__}'s plan names no attention or MLP Linear; give module-name patterns"
        )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)}
    chosen: list[str] = []
    for pattern in targets:
        hits = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            examples = ", ".join(list(linears)[:3]) or "none"
            raise LoRAError(f"lora.targets: {pattern!r} matches no nn.Linear module (Linears: {examples}, ...)")
        chosen += [n for n in hits if n not in chosen]
    for name in chosen:
        if rank > min(linears[name].in_features, linears[name].out_features):
            raise LoRAError(f"lora.rank {rank} exceeds {name}'s smaller dimension; use a smaller rank")
    return sorted(chosen, key=list(linears).index)  # registration order: the draws do not depend on targets


@dataclass(frozen=True)
class Adaptation:
    """What the Adapt transform (meshlm.parallel.strategies) does to the plain model before the strategies see
    it: freeze the parameters matching `freeze` (a run's train.freeze), then, if `lora.rank`, adapt the
    `lora.targets` (default: the plan's attention and MLP projections) with A drawn from `seed` (a run's
    train.seed) and load `lora.init_from`'s adapter."""

    freeze: tuple[str, ...] = ()
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    seed: int = 0

    def check(self, model: nn.Module, plan: object | None = None) -> None:
        """The patterns, the targets and the adapter directory's config checked against `model` (meta is
        enough): a one-line LoRAError, nothing changed."""
        if self.freeze:
            freeze_patterns_match(model, self.freeze)
        lora = self.lora
        if lora.rank:
            lora_targets(model, lora.rank, lora.alpha, lora.dropout, lora.targets or None, plan)
            if lora.init_from:
                read_peft_config(lora.init_from)

    def apply(self, model: nn.Module, plan: object | None = None) -> None:
        """Freeze and adapt `model` in place, after checking everything (`check`)."""
        self.check(model, plan)
        if self.freeze:
            freeze(model, self.freeze)
        lora = self.lora
        if lora.rank:
            apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets or None, plan, seed=self.seed)
            if lora.init_from:
                load_adapter(model, lora.init_from)


@torch.no_grad()
def cast_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Keep the frozen weights of Linear modules in `dtype` (e.g. bf16 under bf16 autocast, which casts every
    Linear weight to bf16 at each use anyway: the same numbers, half the bytes, no fp32 copy). Norms,
    embeddings and trainable parameters are left as they are. Works on a meta model too. Returns how many
    weights were cast."""
    cast = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and not weight.requires_grad and weight.dtype != dtype:
            weight.data = weight.data.to(dtype)
            cast += 1
    return cast


def adapted_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Module names that have adapters in a state dict (keys '<module>.lora_A')."""
    return [k[: -len(".lora_A")] for k in state if k.endswith(".lora_A")]


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base weights with each adapter folded in (W + B·A·scaling), adapter entries dropped: a plain model's
    state dict (for evaluation or export)."""
    out = {k: v for k, v in state.items() if not k.endswith(tuple(f".{p}" for p in ADAPTER_PARAMS))}
    for module in adapted_modules(state):
        a, b = state[f"{module}.lora_A"].float(), state[f"{module}.lora_B"].float()
        weight = out[f"{module}.weight"]
        out[f"{module}.weight"] = (weight.float() + (b @ a) * scaling).to(weight.dtype)
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.endswith(tuple(f".{p}" for p in ADAPTER_PARAMS))}


def export_peft(state: dict[str, torch.Tensor], spec: LoRASpec, directory: str | Path, base_model: str = "") -> Path:
    """Write the adapters of a full (unsharded) state dict as a PEFT LoRA directory: adapter_config.json and
    adapter_model.safetensors with PEFT's key names (base_model.model.<module>.lora_A.weight), loadable with
    `peft.PeftModel.from_pretrained(hf_base_model, directory)`. Target modules are listed by full name."""
    from safetensors.torch import save_file

    adapters = adapter_state(state)
    if not adapters:
        raise LoRAError("export: the model has no LoRA adapters (lora.rank = 0)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"{PEFT_PREFIX}{k}.weight": v.detach().float().cpu().contiguous() for k, v in sorted(adapters.items())}
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": adapted_modules(state),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    atomic_write(directory / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return directory


def read_peft_config(directory: str | Path) -> LoRASpec:
    """The rank, alpha and dropout of a PEFT LoRA directory (its config only); one-line LoRAError otherwise."""
    directory = Path(directory)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(
            f"lora.init_from: {directory} is not a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(config_file.read_text())
        spec = LoRASpec(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0))
    except (ValueError, KeyError, TypeError) as e:
        raise LoRAError(f"lora.init_from: {config_file}: not a LoRA adapter config ({e})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise LoRAError(f"lora.init_from: {config_file}: only plain LoRA adapters load (no DoRA or rsLoRA)")
    return spec


def read_peft(directory: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """(spec, adapters under meshlm's names) of a PEFT LoRA directory; one-line LoRAError when it is not one."""
    from safetensors.torch import load_file

    spec = read_peft_config(directory)
    weights_file = Path(directory) / ADAPTER_WEIGHTS
    adapters = {}
    for key, value in load_file(weights_file).items():
        name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
        name = name.replace(".lora_A.default", ".lora_A").replace(".lora_B.default", ".lora_B")
        adapters[name] = value
    return spec, adapters


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Copy a PEFT adapter directory's weights into `model`'s adapters (after apply_lora, before parallelize).
    Its rank, alpha and adapted modules must be the model's: another base is named in one line."""
    spec, adapters = read_peft(directory)
    own = lora_spec(model)
    if own is None:
        raise LoRAError(f"lora.init_from: {directory}: the model has no adapters; set lora.rank = {spec.rank}")
    if (spec.rank, spec.alpha) != (own.rank, own.alpha):
        raise LoRAError(
            f"lora.init_from: {directory} has rank {spec.rank}, alpha {spec.alpha}; this run has lora.rank "
            f"{own.rank}, lora.alpha {own.alpha}"
        )
    params = dict(model.named_parameters())
    mine = {n for n in params if n.endswith(tuple(f".{p}" for p in ADAPTER_PARAMS))}
    if set(adapters) != mine:
        extra = sorted(set(adapters) - mine) or sorted(mine - set(adapters))
        raise LoRAError(
            f"lora.init_from: {directory} adapts other modules than this model's lora.targets "
            f"(differs at {extra[0]}): an adapter for a different base or targets"
        )
    for name, value in adapters.items():
        if tuple(value.shape) != tuple(params[name].shape):
            raise LoRAError(
                f"lora.init_from: {directory}: {name} has shape {tuple(value.shape)}, this model's is "
                f"{tuple(params[name].shape)}: an adapter for a different base"
            )
        params[name].copy_(value)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base in place (W + B·A·alpha/rank): LoRALinear modules become plain
    nn.Linear ones holding the merged weight, for evaluation or export. Returns `model`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = nn.Parameter(module.weight + (module.lora_B @ module.lora_A) * module.lora_scaling)
            plain.bias = module.bias
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, plain)
    return model
