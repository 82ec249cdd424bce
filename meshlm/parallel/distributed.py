"""Process-group set-up: torchrun's environment when present, else a one-rank gloo group.

A one-rank group keeps a single code path: the trainer always talks to a mesh, even on a laptop.
"""

from __future__ import annotations

import datetime
import gc
import os
import warnings
from typing import Literal

import torch
import torch.distributed as dist

from meshlm.errors import ConfigError


def env_world_size() -> int:
    """World size announced by torchrun (1 for a plain process), known before any group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """This process's global rank as torchrun announces it (0 for a plain process)."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device: torch.device, timeout_s: float) -> bool:
    """Join (or create) the default process group; return True if this call created it."""
    if dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
    ):
        warnings.warn(
            "torchrun shares its rendezvous store across restarts, so a restarted group can read the previous "
            "attempt's addresses and fail to connect (pytorch#135712); launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for reliable restarts",
            stacklevel=2,
        )
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def resolve_device(choice: str) -> torch.device:
    """'auto' picks this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # ParallelOptions.autocast_dtype's values


def resolve_autocast(choice: str, device: torch.device) -> Literal["bf16"] | None:
    """train.dtype as the engine's `autocast_dtype` option: bf16 autocast on GPU by default; fp32 (no autocast)
    on CPU unless asked."""
    if choice == "bf16" or (choice == "auto" and device.type == "cuda"):
        return "bf16"
    return None


# What gloo and NCCL say when a peer process is gone or unreachable (its sockets closed, a timeout). When one
# of a rank's gloo operations times out ("Timed out waiting"), gloo closes every pair of that context, and the
# rank's other operations in flight (an async gradient bucket, a busy machine's later wait) fail with
# "Application timeout caused pair closure" instead (gloo/transport/tcp/unbound_buffer.cc, waitRecv/waitSend)
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "Timed out waiting",
    "Application timeout caused pair closure",
)


def lost_peer(error: BaseException) -> str | None:
    """The first line of a collective's error when it means a peer rank is gone, else None: a rank whose
    peers died cannot save (every save is collective), so it stops with this line instead of a traceback."""
    text = str(error).strip()
    if not isinstance(error, RuntimeError) or not any(mark in text for mark in PEER_LOST):
        return None
    line = text.splitlines()[0] if text else type(error).__name__
    return line.split("] ", 1)[-1].split(" This is typically caused", 1)[0].strip()


def end_process_group() -> None:
    """End the process group after a run that succeeded on every rank (collective), leaving no gloo work or
    worker thread that could touch a Python object once the interpreter is finalizing.

    Why each step (`terminate called without an active exception`, SIGABRT, after the script's last line):
    a gloo group's worker thread drops its hold on a collective's tensors a moment after the caller's wait
    returns, and `destroy_process_group` stops no group that something still references (a ParallelModel's
    or a mesh's in the user's globals: measured, their `pt_gloo_runloop` threads outlive it); such a group is
    destroyed during interpreter finalization, where a last decref of a Python-owned tensor cannot take the GIL
    (pthread_exit under a noexcept frame). So: (1) a barrier on every group this rank belongs to, all started
    before any is waited for (no order to deadlock on): each waits for that group's earlier work, on every
    member; (2) destroy them; (3) collect garbage, so groups held only by reference cycles are destroyed
    (their threads joined) now, while the interpreter is whole. Not after a failure: a barrier with a dead
    peer waits for the timeout."""
    if not dist.is_initialized():
        return
    groups = list(dist.distributed_c10d._world.pg_map)  # every group this rank is a member of, WORLD first
    for work in [dist.barrier(group=group, async_op=True) for group in groups]:
        work.wait()
    del groups
    dist.destroy_process_group()
    gc.collect()
