"""Fault-tolerant replica groups in the training loop, on torchft (Manager, lighthouse, HTTP checkpoint transport).

A run with `fault.replica_groups` = N > 1 is N `meshlm launch`es of one config, group g with env
MESHLM_REPLICA_GROUP=g, joined by `meshlm lighthouse`. `group_config` turns the job's config into the group's
(its batch, its run directory); `ReplicaRun` drives one rank's part of the groups' protocol each step:

  quorum     `Manager.start_quorum` (synchronous: the live count must be known before the loss is formed). A
             group behind the quorum's newest step (relaunched, or back from a stall) heals here from a live peer
             over torchft's HTTP transport: weights, optimizer state and step counts, the step, the data position
             and the loss guard's state, then reseeds its random streams (`reseeded_line`). Every step the live
             groups' indices are exchanged (their order is the fixed order of every cross-group sum), and a
             change is one line: the group that left, or joined.
  batch      the global batch shrinks with the live count (torchft's way): the data position is a sample counter,
             and live group r (in quorum order) takes rows [samples + r·b, samples + (r+1)·b) of the global sample
             stream, b = train.global_batch / N, split over its dp ranks as usual. With every group live, step k
             reads exactly the rows one run of N·dp ranks reads; after a loss the survivors' steps are those of
             one process fed the smaller batches (keeping the batch by accumulation would need N/n micro-batches
             per survivor, n dividing N, and N/n times the step time for the whole outage).
  reduce     meshlm.parallel.dp.replica_groups.Across: the token count, the reported loss, every gradient bucket
             and the unused-parameter flags summed (max) over the live groups in quorum order.
  commit     `Manager.should_commit` between the gradient sync and the optimizer step: False (a peer failed
             mid-step) drops the gradients, leaves weights, guard and data position as they were, and the step
             is redone after the next quorum.

A group loads its disk checkpoint (its own run directory) before its first quorum, so a group that finds no live
peer resumes from disk, never from its initial weights; checkpoints go on as without replica groups.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshlm.checkpoint.rng import start_streams
from meshlm.config import Config, ConfigError
from meshlm.parallel.dp.replica_groups import Across, attach
from meshlm.train.lighthouse import EXTRA_LINE

if TYPE_CHECKING:
    from meshlm.train.trainer import Trainer

GROUP_ENV = "MESHLM_REPLICA_GROUP"
# Testing only: while fewer than fault.replica_groups groups are live, each step waits this long first, so that a
# relaunched group (seconds of start-up) still finds its peers running in a short test.
PACE_ENV = "MESHLM_SHORT_STEP_SLEEP_S"


def group_index(n_groups: int) -> int:
    """This group's index, from env MESHLM_REPLICA_GROUP (0..N-1): one line otherwise."""
    text = os.environ.get(GROUP_ENV, "")
    if not text.isdigit() or int(text) >= n_groups:
        raise ConfigError(
            f"fault.replica_groups = {n_groups}: env {GROUP_ENV} must be this group's index 0..{n_groups - 1}, "
            f"got {text!r} (each group's `meshlm launch` sets its own)"
        )
    return int(text)


def lighthouse_address(cfg: Config) -> str:
    """fault.lighthouse, else env TORCHFT_LIGHTHOUSE, as the http://HOST:PORT torchft dials."""
    address = cfg.fault.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError(
            "fault.lighthouse: the lighthouse's HOST:PORT is needed with fault.replica_groups > 1 (or env "
            "TORCHFT_LIGHTHOUSE); start one with `meshlm lighthouse --port 29510`"
        )
    return address if "://" in address else f"http://{address}"


def group_config(cfg: Config) -> Config:
    """The config one group trains with: train.global_batch / N rows per step (refused unless it divides), its
    own run directory (log.run_dir/group-G: checkpoints, metrics and the run lock of each group), a host sync
    every step (the commit is read there). Refusals are one line, before any work starts."""
    n = cfg.fault.replica_groups
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum service logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(EXTRA_LINE) from None
    if cfg.train.global_batch % n:
        raise ConfigError(
            f"train.global_batch = {cfg.train.global_batch} does not split over fault.replica_groups = {n}: each "
            f"group takes global_batch / {n} rows; use a multiple of {n}"
        )
    if cfg.parallel.zero != 0:  # ZeRO 0 is what the recovery tests prove exact (docs/fault-tolerance.md)
        raise ConfigError(
            f"parallel.zero = {cfg.parallel.zero} with fault.replica_groups > 1: live recovery is proven exact for "
            "ZeRO 0 inside a group (a sharded state heals only shard by shard, untested), and a lost shard with no "
            "replica falls back to checkpoint restart; use parallel.zero 0, or fault.replica_groups 1"
        )
    if cfg.train.sync_every not in (1, "auto"):
        raise ConfigError(
            f"train.sync_every = {cfg.train.sync_every}: with fault.replica_groups > 1 every step's commit is "
            "read on the host; use 1 or auto"
        )
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        raise ConfigError(
            "meshlm launch --max-restarts: a replica group is relaunched as a new `meshlm launch` (torchrun's "
            "in-place restart of a gloo group reads the dead attempt's addresses); use --max-restarts 0"
        )
    group = group_index(n)
    lighthouse_address(cfg)
    run_dir = str(Path(cfg.log.run_dir) / f"group-{group}")
    return cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"global_batch": cfg.train.global_batch // n, "sync_every": 1}),
            "log": cfg.log.model_copy(update={"run_dir": run_dir}),
        }
    )


def _process_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group for the cross-group traffic: gloo on CPU, NCCL on CUDA."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


class ReplicaRun:
    """One rank's side of the replica groups' protocol (module docstring), over `trainer`'s model, optimizer,
    sampler and guard. Built before the trainer resumes from disk; the Manager's step follows the resume."""

    def __init__(self, cfg: Config, trainer: Trainer) -> None:
        from torchft import Manager

        self.trainer, self.cfg = trainer, cfg
        self.n_groups = cfg.fault.replica_groups
        self.group = group_index(self.n_groups)
        self.rows = cfg.train.global_batch  # per group (group_config divided it)
        self.samples = 0  # the data position: global samples of the stream consumed by committed steps
        self.live: list[int] | None = None  # group indices of the current quorum, in its order
        # this process's incarnation of its group: a relaunch that replaces a dead member before the survivors
        # ever stepped without it keeps the group index, not the incarnation (so they still name the loss)
        self.incarnation = int.from_bytes(os.urandom(7), "big")
        self.incarnations: dict[int, int] = {}
        self.healed_to: int | None = None
        self.pace = float(os.environ.get(PACE_ENV, "0") or 0)
        source = getattr(trainer.sampler, "source", None)
        if not hasattr(source, "rows_at"):
            raise ConfigError(
                "fault.replica_groups > 1 reads meshlm's token data by sample position (data.source); a batch "
                "source of one's own (fit(data=...)) or SFT data cannot shrink its batch with the live groups"
            )
        self.source = source
        timeout = timedelta(seconds=cfg.fault.collective_timeout_s)
        self.pg = _process_group(trainer.device, timeout)
        store = {}
        if "MASTER_ADDR" not in os.environ:  # one process, no launcher: a store of its own for the Manager
            from torch.distributed import TCPStore

            self._store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": socket.gethostname(), "store_port": self._store.port, "rank": 0, "world_size": 1}
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,  # the live count is needed before the loss is formed
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.fault.quorum_timeout_s),
            connect_timeout=timeout,
            lighthouse_addr=lighthouse_address(cfg),
            replica_id=f"{self.group:04d}",  # the lighthouse orders groups by it: group 0 first when all live
            **store,
        )
        self.across = Across(self.pg, self.manager)
        attach(trainer.model, self.across)

    # ---- state: checkpoints and heals -----------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, int]:
        """What a checkpoint records of the groups: the sample position (the step alone no longer fixes it)."""
        return {"samples": self.samples, "groups": self.n_groups}

    def resumed(self, saved: dict | None) -> None:
        """After the disk resume (or a fresh start: None): the data position and the Manager's step follow it.
        A checkpoint of a run without replica groups read every step's whole batch."""
        step = self.trainer.sampler.step
        if saved is not None:
            self.samples = saved.get("replica_groups", {}).get("samples", step * self.rows * self.n_groups)
        self.manager.load_state_dict({"step": step, "batches_committed": self.samples // self.rows})

    def _tensors(self) -> list[torch.Tensor]:
        """This rank's training tensors in a fixed order (every group has the same layout): each optimizer tensor
        (parameter, or ZeRO master piece), then its optimizer state, step counts included."""
        out = []
        optimizer = self.trainer.optimizer
        for _, tensor in self.trainer.model.named_optimizer_tensors():
            out.append(tensor.detach())
            state = optimizer.state.get(tensor, {})
            out += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
        return out

    def _state(self) -> dict[str, Any]:
        """What a healing peer gets from this rank (served by reference until this group's next commit)."""
        t = self.trainer
        host = {"sampler": t.sampler.state_dict(), "samples": self.samples, "guard": t.guard.state_dict(),
                "vetoed_run": t.vetoed_run}  # fmt: skip
        return {"tensors": self._tensors(), "host": host}

    @torch.no_grad()
    def _load(self, state: dict[str, Any]) -> None:
        """A peer's state into this rank's live tensors (called by the Manager inside `start_quorum`)."""
        t = self.trainer
        mine = self._tensors()
        if len(mine) != len(state["tensors"]):
            raise RuntimeError(f"heal: the peer sent {len(state['tensors'])} tensors, this rank holds {len(mine)}")
        for tensor, theirs in zip(mine, state["tensors"], strict=True):
            tensor.copy_(theirs)
        host = state["host"]
        t.sampler.load_state_dict(host["sampler"])
        self.samples = host["samples"]
        t.guard.load_state_dict(host["guard"])
        t.vetoed_run = host["vetoed_run"]
        self.healed_to = t.sampler.step

    # ---- the step ---------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """The quorum (healing this rank if it is behind), then the live groups' order and what changed."""
        if self.pace and self.live is not None and len(self.live) < self.n_groups:
            time.sleep(self.pace)
        t = self.trainer
        before = t.sampler.step
        self.manager.start_quorum()
        if self.healed_to is not None:
            t.model.after_load()  # ZeRO: working weights from the healed masters
            start_streams(None, self.cfg.train.seed, self.healed_to)
            t.say(
                f"replica group {self.group}: healed from a live peer at step {self.healed_to} (was at step "
                f"{before}): weights, optimizer, data position and guard; random streams seeded from train.seed "
                f"and step {self.healed_to}, as a resume at another world size",
                flush=True,
            )
            self.healed_to = None
        ids = torch.tensor([self.group, self.incarnation], dtype=torch.int64)
        gathered = self.across.gather(ids)
        if gathered is None:
            return  # this step fails: it is redone after the next quorum
        live = [int(x[0].item()) for x in gathered]
        incarnations = {int(x[0].item()): int(x[1].item()) for x in gathered}
        replaced = sorted(g for g in live if self.incarnations.get(g, incarnations[g]) != incarnations[g])
        self.incarnations = incarnations
        if live != self.live:  # the schedule of live groups, for a replay of the run (and the one line below)
            t.log(t.sampler.step + 1, "replicas", live=live, live_groups=len(live))
        if self.live is not None and (live != self.live or replaced):
            gone = sorted(set(self.live) - set(live))
            came = sorted(set(live) - set(self.live))
            change = "; ".join(
                ([f"group {', '.join(map(str, gone))} left (dead, stalled or cut off)"] if gone else [])
                + ([f"group {', '.join(map(str, came))} joined"] if came else [])
                + ([f"group {', '.join(map(str, replaced))} left (dead) and its relaunch joined"] if replaced else [])
            )
            t.say(
                f"replica groups at step {t.sampler.step + 1}: {change or 'reordered'}; stepping with {len(live)} of "
                f"{self.n_groups} (groups {', '.join(map(str, live))})",
                flush=True,
            )
        self.live = live

    def batch(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the step: its group's share at its place in the quorum, split over dp."""
        place = self.live.index(self.group) if self.live and self.group in self.live else 0
        per_rank = self.rows // dp
        return self.source.rows_at(self.samples + place * self.rows + dp_rank * per_rank, per_rank)

    def commit(self) -> bool:
        """Whether every rank of this group completed the step (torchft's vote); on True the data position
        advances by the live groups' rows."""
        if not self.manager.should_commit():
            error = self.manager.errored()
            why = (
                str(error.original_exception).splitlines()[0] if error is not None else "a rank of this group failed it"
            )
            why = why.split(". This is typically")[0]  # gloo's advice after the cause
            step = self.trainer.sampler.step + 1
            self.trainer.say(f"step {step}: not committed ({why}); redone after the next quorum", flush=True)
            return False
        live = len(self.live) if self.live else 1
        self.samples += live * self.rows
        sampler = self.trainer.sampler
        sampler.load_state_dict({**sampler.state_dict(), "step": sampler.step + 1})
        return True

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The model's token counts and losses inside this group only (evaluation: every group reads the same
        batches, so a sum over groups would count them N times, and a quorum is not held there)."""
        model = self.trainer.model
        model.across = None
        try:
            yield
        finally:
            model.across = self.across

    def close(self) -> None:
        self.manager.shutdown(wait=False)
