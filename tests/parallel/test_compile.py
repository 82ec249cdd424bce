"""`train.compile`: every block compiled after parallelization trains as eager does; the config switches
(`train.compile`, `train.recompute`) reach the model the trainer builds.

The tests compile with backend 'aot_eager' (traced by dynamo and AOTAutograd, run by eager kernels): the
graph capture and the compiled backward are exercised in ~2 s, where inductor's C++ build of the same
kernels takes ~30 s on two CPU cores; one slow test runs inductor itself, in one process, and
benchmarks/compile.py times it (losses within 3e-6 over 20 steps)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from distributed import run_shared
from equivalence import LOSS_RTOL
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

import meshlm
from meshlm.config import load_config, parse_overrides
from meshlm.model import Transformer, preset
from meshlm.model.llama import Attention
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.transforms.compile import compile_blocks
from meshlm.train import trainer as trainer_module
from meshlm.train.optim import train_step
from meshlm.train.parts import Callback


def _losses(layout: str, compiled: bool, backend: str = "aot_eager") -> list[float]:
    torch.manual_seed(0)
    mesh = build_mesh(parse_layout(layout, torch.distributed.get_world_size()), "cpu")
    pm = meshlm.parallelize(Transformer(preset("test")), mesh, {"compile": compiled, "compile_backend": backend})
    blocks = pm.chunks[0].model.layers.values()
    assert sum(block._compiled_call_impl is not None for block in blocks) == (
        preset("test").n_layers if compiled else 0
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        x = torch.randint(0, 512, (4, 33), generator=gen)
        losses.append(train_step(pm, opt, x[:, :-1], x[:, 1:], 3e-3, 1.0)[0])
    return losses


def _eager_and_compiled(layout: str, backend: str = "aot_eager") -> list[list[float]]:
    return [_losses(layout, compiled, backend) for compiled in (False, True)]


@pytest.mark.slow  # aot_eager compiles of the blocks, on one rank and under tp=2: ~11 s
def test_compiled_blocks_train_as_eager() -> None:
    """In one process, and with tensor-parallel blocks (the compiled graph holds their collectives)."""
    for layout, world in (("dp=1", 1), ("dp=1,tp=2", 2)):
        eager, compiled = run_shared(_eager_and_compiled, world, layout)[0]
        for a, b in zip(eager, compiled, strict=True):
            assert abs(b / a - 1) <= LOSS_RTOL, (layout, a, b)


@pytest.mark.slow  # inductor generates and builds C++ kernels: ~30 s on two cores
def test_inductor_blocks_train_as_eager() -> None:
    """Inductor's fused kernels reorder float32 sums, so losses agree to LOSS_RTOL, not bit for bit."""
    eager, compiled = run_shared(_eager_and_compiled, 1, "dp=1", "inductor")[0]
    for a, b in zip(eager, compiled, strict=True):
        assert abs(b / a - 1) <= LOSS_RTOL, (a, b)


def _inductor_cache_folder(capability: str | None, folder_before: str | None) -> str | None:
    """TORCHINDUCTOR_CACHE_DIR after compile_blocks with the given environment (None: unset); the rank's
    environment is restored after."""
    with mock.patch.dict(os.environ):
        for key in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR"):
            os.environ.pop(key, None)
        given = {"ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": folder_before}
        os.environ.update({key: value for key, value in given.items() if value is not None})
        mesh = build_mesh(parse_layout("dp=1", 1), "cpu")
        pm = parallelize(Transformer(preset("test")), mesh)
        compile_blocks(pm.chunks, pm.plan, "inductor")
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def test_a_forced_cpu_capability_compiles_into_a_cache_of_its_own() -> None:
    """Inductor's FX-graph cache does not key on the vector ISA: AVX2 code cached by a run on the default
    kernels fails to build under ATEN_CPU_CAPABILITY=default. Each forced capability gets its own folder,
    whether or not importing dynamo already wrote the default one into the environment; a folder the user
    chose is kept; without a forced capability nothing changes."""
    default = default_cache_dir()
    for before in (None, default):
        assert run_shared(_inductor_cache_folder, 1, "default", before)[0] == f"{default}-default"
        assert run_shared(_inductor_cache_folder, 1, "avx2", before)[0] == f"{default}-avx2"
        assert run_shared(_inductor_cache_folder, 1, None, before)[0] in (before, default)
    assert run_shared(_inductor_cache_folder, 1, "default", "/tmp/mine")[0] == "/tmp/mine"


class _Probe(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        modules = list(trainer.model.chunks[0].modules())
        self.seen = {
            "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
            "recompute_core": sum(m.recompute_core for m in modules if isinstance(m, Attention)),
        }


def test_config_switches_reach_the_model(small_run: list[str]) -> None:
    run_dir = Path(small_run[small_run.index("--log.run_dir") + 1])
    results, probe = [], _Probe()
    for name, extra in (("eager", []), ("compiled", ["--train.compile", "true", "--train.compile_backend",
                                                     "aot_eager", "--train.recompute", "selective"])):  # fmt: skip
        args = [*small_run, "--train.steps", "10", "--train.eval_every", "0", "--checkpoint.every", "0",
                "--log.run_dir", str(run_dir / name), *extra]  # fmt: skip
        results.append(trainer_module.fit(load_config(None, parse_overrides(args)), callbacks=[probe]))
    assert probe.seen == {"compiled": preset("test").n_layers, "recompute_core": preset("test").n_layers}
    for eager, compiled in zip(results[0].losses, results[1].losses, strict=True):
        assert abs(compiled / eager - 1) <= LOSS_RTOL, (eager, compiled)
