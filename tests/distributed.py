"""Run a function on N gloo ranks on localhost and collect each rank's return value.

Each test spawns one process group and runs many checks inside it. Every rank has a collective timeout
and the parent kills the whole group after `timeout` seconds, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str, pg_timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(*args)
        payload = ("ok", result)
    except BaseException as e:
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    path.write_bytes(pickle.dumps(payload))


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 180, pg_timeout: float = 60) -> list[Any]:
    """Call fn(*args) on `world` ranks; return the per-rank results or raise with the first rank's error."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir, pg_timeout), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s")
        results = []
        for r in range(world):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        return results
