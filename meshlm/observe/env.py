"""The environment a run trained in, logged once so a report can say where its numbers came from."""

from __future__ import annotations

import platform
import socket

import torch
import torch.distributed as dist


def cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else whatever platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment(device: torch.device, layout: str = "") -> dict[str, str | int | float]:
    """torch / python versions, host, device, backend, world size and layout (as a `kind="env"` record:
    strings are fine in metrics.jsonl, TensorBoard skips them)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cuda": torch.version.cuda or "",
        "backend": dist.get_backend() if dist.is_initialized() else "",
        "world_size": world,
        "layout": layout,
    }
