"""Helpers shared by the tests and the benchmarks: run a function on N gloo ranks on localhost, and the
deterministic learnable batches every layout is compared on.

`run_distributed` starts a fresh process group per call (what a test of failures, timeouts or exits needs).
`run_shared` runs the call on a process group kept alive between calls of the same world size, so a test
suite pays the start, the imports and the rendezvous once per world size instead of once per test. Either
way every rank has a collective timeout and the caller kills the group after `timeout` seconds, so a hang
fails the caller instead of hanging it; a shared group that failed or timed out is killed and the next
call starts a fresh one.

Ranks start by START_METHOD: "spawn" (a fresh interpreter each, ~2 s of imports per rank) unless a caller
sets "forkserver", as the tests do: one clean server process imports FORKSERVER_PRELOAD once and forks
each rank from it (it never runs an op or starts a thread pool, so the forks are safe), ~0.1 s a group.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = "spawn"
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "meshlm.checkpoint", "meshlm.parallel.engine", "meshlm.train.optim"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts, on first use
    return ctx


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batch(step: int, batch: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (a random start, then a fixed affine rule with occasional random tokens), a pure
    function of (seed, step): the same global batch for every layout, and a loss that really falls."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(1, seq_len + 1):
        tokens[:, t] = (tokens[:, t - 1] * 5 + 3) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def mask_prompts(targets: torch.Tensor, step: int, fraction: float, seed: int = 0) -> torch.Tensor:
    """Fine-tuning labels: a copy of `targets` whose rows each begin with a "prompt" of -100 labels, of a
    random length in [0, 2·fraction·seq_len] (so about `fraction` of all labels, unevenly per row: replicas,
    micro-batches and cp shards of the same global batch keep different numbers of tokens), plus ~5% of
    the remaining labels -100 at random (padding inside a packed row). A pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 100_019 + step + 7)
    rows, seq_len = targets.shape
    masked = targets.clone()
    prompt = torch.randint(0, int(2 * fraction * seq_len) + 1, (rows,), generator=g).clamp(max=seq_len)
    masked[torch.arange(seq_len).unsqueeze(0) < prompt.unsqueeze(1)] = -100
    masked[torch.rand(rows, seq_len, generator=g) < 0.05] = -100
    return masked


def rank_threads() -> int:
    """Intra-op threads of each rank (and of the tests' one-process references): 1, or MESHLM_TEST_THREADS
    (`make test-portability THREADS=2` reruns the equivalence tests with other reduction splits)."""
    return int(os.environ.get("MESHLM_TEST_THREADS", "1"))


def _init_rank(rank: int, world: int, port: int, pg_timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads()))
    torch.set_num_threads(rank_threads())
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))


def _call(rank: int, fn: Callable, args: tuple) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except BaseException as e:
        return "error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"


# ---- a fresh process group per call -----------------------------------------------------------------
def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str, pg_timeout: float) -> None:
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        _init_rank(rank, world, port, pg_timeout)
        payload = _call(rank, fn, args)
    except BaseException as e:
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    path.write_bytes(pickle.dumps(payload))


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 180, pg_timeout: float = 60) -> list[Any]:
    """Call fn(*args) on `world` freshly started ranks; return the per-rank results or raise with the first
    rank's error."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir, pg_timeout), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s")
        paths = [Path(out_dir) / f"rank{r}.pkl" for r in range(world)]
        dead = [r for r in range(world) if not paths[r].exists()]
        if dead:  # the cause: the others' errors are only the closed connections it left behind
            raise RuntimeError(f"ranks {dead} died without a result (exit codes {[procs[r].exitcode for r in dead]})")
        results = []
        for path in paths:
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        return results


# ---- a process group shared by many calls -----------------------------------------------------------
def _pool_worker(rank: int, world: int, port: int, pg_timeout: float, tasks, results, parent: int) -> None:
    try:
        _init_rank(rank, world, port, pg_timeout)
    except BaseException as e:
        results.put((None, rank, pickle.dumps(("error", f"rank {rank}: set-up: {type(e).__name__}: {e}"))))
        return
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if not _alive(parent):  # the caller is gone: do not outlive it (forkserver ranks are not its children)
                os._exit(1)
            continue
        if item is None:
            break
        task, payload = item
        try:
            fn, args = pickle.loads(payload)
            out = pickle.dumps(_call(rank, fn, args))
        except BaseException as e:  # an unpicklable task or result
            out = pickle.dumps(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        _destroy_task_groups()
        results.put((task, rank, out))
    dist.destroy_process_group()


def _destroy_task_groups() -> None:
    """The groups a task made (its meshes', its checkpointer's) end with it, so a rank that runs hundreds of
    tasks does not pile up their gloo threads, sockets and buffers; every rank destroys the same ones."""
    world = dist.GroupMember.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


class SharedGroup:
    """`world` gloo ranks that run one call after another (see `run_shared`)."""

    def __init__(self, world: int, pg_timeout: float = 60) -> None:
        ctx = _context()
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, world, port, pg_timeout, self.tasks[r], self.results, os.getpid()),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.next_task = 0

    def run(self, fn: Callable, *args: Any, timeout: float = 180) -> list[Any]:
        payload = pickle.dumps((fn, args))  # here, so a task that cannot be pickled fails in the caller
        task, self.next_task = self.next_task, self.next_task + 1
        for q in self.tasks:
            q.put((task, payload))
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.world:
            try:
                done, rank, out = self.results.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = [self.procs[r].exitcode for r in dead]
                    raise RuntimeError(f"ranks {dead} died without a result (exit codes {codes})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(got))
                    raise TimeoutError(f"ranks {missing} still running after {timeout}s") from None
                continue
            if done in (task, None):
                got[rank] = pickle.loads(out)
                if got[rank][0] == "error":
                    raise RuntimeError(got[rank][1])
        return [got[r][1] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """End the ranks now: they hold nothing worth a graceful shutdown (which costs ~0.4 s per rank)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        for q in [*self.tasks, self.results]:
            q.close()
            q.cancel_join_thread()


_SHARED: dict[tuple[int, float], SharedGroup] = {}


def run_shared(fn: Callable, world: int, *args: Any, timeout: float = 180, pg_timeout: float = 60) -> list[Any]:
    """Like `run_distributed`, on a process group of `world` ranks that outlives the call: the next call of
    the same world size (and pg_timeout) reuses it. The call must leave the ranks as it found them (undo
    its patches, join its threads); a call that raises or times out kills the group."""
    key = (world, pg_timeout)
    group = _SHARED.get(key)
    if group is None or not group.alive():
        if group is not None:
            group.close()
        group = _SHARED[key] = SharedGroup(world, pg_timeout)
    try:
        return group.run(fn, *args, timeout=timeout)
    except BaseException:
        _SHARED.pop(key, None)
        group.close()
        raise


def shared_group_alive(world: int, pg_timeout: float = 60) -> bool:
    """Whether `run_shared` holds a live group of `world` ranks (with that pg_timeout) for the next call."""
    group = _SHARED.get((world, pg_timeout))
    return group is not None and group.alive()


@atexit.register
def close_shared_groups() -> None:
    """End every shared group's ranks (they also exit on their own once the caller is gone)."""
    while _SHARED:
        _, group = _SHARED.popitem()
        group.close()
