"""Every rank holds exactly the bytes docs/zero.md predicts for each ZeRO stage (padding included), ZeRO-3 frees
gathered weights as it goes, and the sharded state dict covers every element exactly once.

One world-4 group builds each configuration on a model whose flat buffers need padding, takes a step, reports.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from dp_helpers import build
from equivalence import global_batch

from meshlm.model import ModelConfig, Transformer
from meshlm.observe.memory import ActivationMeter, MemoryProbe
from meshlm.train.optim import train_step

WORLD = 4
# dim 42 and an odd vocabulary: several flat buffers are not multiples of 4 elements, so shards need padding.
MODEL = ModelConfig(vocab_size=253, dim=42, n_layers=6, n_heads=3, n_kv_heads=1, intermediate_size=50, max_seq_len=64)
ONE_BUCKET_MB = 1000.0  # one flat buffer per kind for zero 0-2, so the expected sizes follow from the shapes alone

# name -> (zero, DataParallel options)
CASES = {
    "zero0": (0, {}),
    "zero1": (1, {}),
    "zero2": (2, {}),
    "zero3": (3, {}),
    "hybrid zero1": (1, {"shard_group_size": 2}),
    "hybrid zero2": (2, {"shard_group_size": 2}),
    "hybrid zero3": (3, {"shard_group_size": 2}),
    "zero1 bf16": (1, {"param_dtype": torch.bfloat16}),
    "zero2 bf16": (2, {"param_dtype": torch.bfloat16}),
    "zero3 bf16": (3, {"param_dtype": torch.bfloat16}),
    "zero1 bf16 accumulating in bf16": (1, {"param_dtype": torch.bfloat16, "grad_accum_dtype": torch.bfloat16}),
}


def one_step(pm, opt, train) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, 8, 16, MODEL.vocab_size)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    train_step(pm, opt, x[rows], y[rows], 1e-3, 1.0)


def peak_param_bytes(pm, opt, train) -> int:
    """Parameter bytes held after every block forward and every gradient accumulation of one step."""
    peaks = []

    def record(*_: object) -> None:
        peaks.append(pm.dp.memory_report()["params"])

    chunk = pm.chunks[0]
    for block in chunk.model.layers.values():
        block.register_forward_hook(record)
    for p in chunk.parameters():
        p.register_post_accumulate_grad_hook(record)
    one_step(pm, opt, train)
    return max(peaks)


def job() -> dict:
    out = {}
    for name, (zero, options) in CASES.items():
        pm, opt, train = build(MODEL, zero, ONE_BUCKET_MB, **options)
        one_step(pm, opt, train)
        with ActivationMeter(pm) as meter:  # the second step: every unit gathered once before, freed since
            one_step(pm, opt, train)
        pieces = pm.dp.sharded_state_dict(opt)
        out[name] = {
            "memory": pm.dp.memory_report(opt),
            "probe": MemoryProbe(pm, opt).measure(),  # what metrics.jsonl reports (mem_*_bytes)
            "activations": meter.peak,  # log.activation_memory's figure
            "pieces": {
                k: [(s.name, tuple(s.global_shape), s.offset, s.local.clone()) for s in v] for k, v in pieces.items()
            },
            "full": pm.full_state_dict(),
        }
        if zero == 3:
            out[name]["peak_params"] = peak_param_bytes(pm, opt, train)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_shared(job, WORLD, timeout=300)


def padded(n: int, shards: int) -> int:
    return -(-n // shards) * shards


def flat_buffer_sizes(zero: int) -> list[list[int]]:
    """Element counts of the flat buffers meshlm builds, grouped by unit: per kind (matrices, vectors) over the
    whole model for zero 0-2 with one big bucket; per kind within each ZeRO-3 unit (embedding, each block,
    norm + head)."""
    model = Transformer(MODEL)
    if zero < 3:
        units = [list(model.parameters())]
    else:
        units = [[model.model.embed_tokens.weight]]
        units += [list(block.parameters()) for block in model.model.layers.values()]
        units += [[model.model.norm.weight, model.lm_head.weight]]
    sizes = []
    for params in units:
        kinds = [sum(p.numel() for p in params if (p.ndim >= 2) == matrix) for matrix in (True, False)]
        sizes.append([n for n in kinds if n])
    return sizes


def expected_bytes(zero: int, shards: int, param_bytes: int, shard_rank: int, grad_bytes: int = 4) -> dict[str, int]:
    """docs/zero.md: Ψ elements, Ψp padded to a multiple of the shard group S; fp32 masters (4 bytes) are
    separate from the working weights only when those are not fp32, and the fp32 reduced-gradient shard from
    ZeRO-1's full gradient buffer only when that is not fp32 (parallel.grad_accum_dtype); Adam holds two fp32
    moments (8 bytes) per element of the parameter pieces it steps: this rank's shards without their padding
    (Ψr)."""
    sizes = [n for unit in flat_buffer_sizes(zero) for n in unit]
    psi_r = sum(min(max(n - shard_rank * (padded(n, shards) // shards), 0), padded(n, shards) // shards) for n in sizes)
    if zero == 0:
        psi = sum(sizes)
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    psi_p = sum(padded(n, shards) for n in sizes)
    shard = psi_p // shards
    master = 0 if param_bytes == 4 else 4 * shard
    grad_shard = 0 if grad_bytes == 4 else 4 * shard
    full_weights, full_grads = param_bytes * psi_p, grad_bytes * psi_p
    return {
        "params": (full_weights + master) if zero < 3 else 4 * shard,
        "grads": (full_grads + grad_shard) if zero == 1 else 4 * shard,
        "optimizer": 8 * psi_r,
    }


def test_flat_buffers_need_padding() -> None:
    """Guards the next test: with no padding it would not check that padding is counted."""
    assert any(n % WORLD for zero in (1, 3) for unit in flat_buffer_sizes(zero) for n in unit)


@pytest.mark.parametrize("name", list(CASES))
def test_memory_matches_formula_on_every_rank(ranks: list[dict], name: str) -> None:
    zero, options = CASES[name]
    shards = options.get("shard_group_size", WORLD)
    param_bytes = torch.finfo(options.get("param_dtype", torch.float32)).bits // 8
    grad_bytes = torch.finfo(options.get("grad_accum_dtype", torch.float32)).bits // 8
    for rank, result in enumerate(ranks):
        expected = expected_bytes(zero, shards, param_bytes, rank % shards, grad_bytes)
        assert result[name]["memory"] == expected, f"rank {rank}"


@pytest.mark.parametrize("name", ["zero3", "hybrid zero3", "zero3 bf16"])
def test_zero3_metrics_count_the_shards_not_the_freed_weights(ranks: list[dict], name: str) -> None:
    """Between steps a ZeRO-3 rank holds its fp32 shards (the optimizer steps their unpadded pieces, 4 Ψr bytes)
    and no gathered weight: the freed ones (storage of 0 bytes, every one at address 0) count nothing."""
    shards = CASES[name][1].get("shard_group_size", WORLD)
    for rank, result in enumerate(ranks):
        psi_r = expected_bytes(3, shards, 4, rank % shards)["optimizer"] // 2
        assert result[name]["probe"]["mem_params_bytes"] == psi_r, f"rank {rank}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_logged_gradient_bytes_are_the_buffers(ranks: list[dict], name: str) -> None:
    """metrics.jsonl's mem_grads_bytes (MemoryProbe) is what data parallel holds in gradients — also where its
    buffers are no parameter's .grad (fp32 accumulation under bf16 working weights, where counting .grad read
    only ZeRO-1's shard)."""
    for rank, result in enumerate(ranks):
        assert result[name]["probe"]["mem_grads_bytes"] == result[name]["memory"]["grads"], f"rank {rank}"


@pytest.mark.parametrize("name", [name for name in CASES if name != "zero0" and "bf16" not in name])
def test_activation_memory_does_not_depend_on_the_zero_stage(ranks: list[dict], name: str) -> None:
    """ZeRO shards weights, gradients and optimizer state, never activations: the meter's peak (tensors saved
    for backward, weights excluded, gathered ones too) is zero 0's on every rank (bf16 saves 2-byte ones)."""
    for rank, result in enumerate(ranks):
        assert result[name]["activations"] == result["zero0"]["activations"] > 0, f"rank {rank}"


@pytest.mark.parametrize("name", ["zero3", "hybrid zero3", "zero3 bf16"])
def test_zero3_frees_gathered_weights(ranks: list[dict], name: str) -> None:
    """While training, a rank holds its shards plus at most three gathered units (current, prefetched, tied)."""
    memory = ranks[0][name]["memory"]
    shards = CASES[name][1].get("shard_group_size", WORLD)
    param_bytes = torch.finfo(CASES[name][1].get("param_dtype", torch.float32)).bits // 8
    units = [param_bytes * sum(padded(n, shards) for n in unit) for unit in flat_buffer_sizes(3)]
    peak = ranks[0][name]["peak_params"]
    assert memory["params"] < peak <= memory["params"] + 3 * max(units)
    assert peak < memory["params"] + sum(units)  # never the whole model


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_state_dict_covers_every_element_once(ranks: list[dict], name: str) -> None:
    full = ranks[0][name]["full"]
    for key in ("model", "exp_avg", "exp_avg_sq"):
        rebuilt = {n: torch.zeros(t.numel()) for n, t in full.items()}
        counts = {n: torch.zeros(t.numel()) for n, t in full.items()}
        for result in ranks:
            for piece_name, shape, offset, local in result[name]["pieces"][key]:
                assert shape == tuple(full[piece_name].shape)
                rebuilt[piece_name][offset : offset + local.numel()] += local.float()
                counts[piece_name][offset : offset + local.numel()] += 1
        for n, count in counts.items():
            assert torch.equal(count, torch.ones_like(count)), f"{key} {n}"
        if key == "model":
            for n, t in full.items():
                assert torch.equal(rebuilt[n].view_as(t), t), n
