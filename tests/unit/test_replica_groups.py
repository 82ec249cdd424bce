"""Fault-tolerant replica groups, the pieces without processes: the fixed-order cross-group sums (Across), the
group's config and its one-line refusals, the lighthouse command's refusals, the sample-position reads of the
sampler and the guard's state a heal carries (issue #52; end to end:
tests/integration/test_replica_groups_recovery.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from meshlm.config import ConfigError, load_config
from meshlm.data.sampler import GlobalBatchSampler
from meshlm.parallel.dp.replica_groups import Across
from meshlm.train.guards import StepGuard


class FakeManager:
    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> object:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e


class FakeWork:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def wait(self) -> bool:
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        return True


class FakePG:
    """torchft's process group as Across sees it: this rank's tensor is `peers[rank]`, the others' come from
    `peers` (what every live group contributed, in quorum order)."""

    def __init__(self, peers: list[torch.Tensor], rank: int, fail: bool = False) -> None:
        self.peers, self.rank, self.fail, self.calls = peers, rank, fail, 0

    def size(self) -> int:
        return len(self.peers)

    def allgather(self, outs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object) -> FakeWork:
        self.calls += 1
        assert torch.equal(inputs[0], self.peers[self.rank])
        for out, peer in zip(outs[0], self.peers, strict=True):
            out.copy_(peer)
        return FakeWork(self.fail)


# Three fp32 terms whose sum depends on the order: (t0 + t1) + t2 = 0 (t0 is lost beside 1e8), (t2 + t1) + t0 = 1.
TERMS = [torch.tensor([1.0]), torch.tensor([1e8]), torch.tensor([-1e8])]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_sum_is_in_quorum_order_on_every_group(rank: int) -> None:
    """Every group gets ((t0 + t1) + t2), whatever its own place: the bits one process gets adding the groups'
    terms in quorum order. Mutation: summing the gathered terms in reverse gives 1.0 instead."""
    mine = TERMS[rank].clone()
    Across(FakePG(TERMS, rank), FakeManager()).sum_(mine)
    assert mine.item() == ((TERMS[0] + TERMS[1]) + TERMS[2]).item() == 0.0


def test_a_failed_collective_is_reported_not_raised_and_ends_the_step_traffic() -> None:
    """A peer that dies mid-collective: the error goes to the Manager (the step will not commit), the tensor is
    left alone, and no further collective of that step is attempted (its peers would wait a timeout for it)."""
    manager, pg = FakeManager(), FakePG([torch.ones(2), torch.ones(2)], 0, fail=True)
    across = Across(pg, manager)
    mine = torch.ones(2)
    across.sum_(mine)
    assert isinstance(manager.error, RuntimeError) and torch.equal(mine, torch.ones(2))
    across.sum_(mine)
    assert pg.calls == 1


def test_max_and_the_gradients_of_one_rank_groups() -> None:
    """sum_grads: a parameter unused here but used in another group gets zeros plus the others' gradient (every
    group steps it); one unused everywhere keeps no gradient (the optimizer skips it, as one process would)."""
    used_here, used_there, unused = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    used_here.grad = torch.tensor([1.0, 2.0])
    # the peer group (rank 1) used `used_there` only; the flags are gathered first, then the flat gradients
    flags = [torch.tensor([1, 0, 0], dtype=torch.uint8), torch.tensor([0, 1, 0], dtype=torch.uint8)]
    flat = [torch.tensor([1.0, 2.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 5.0, 6.0])]

    class TwoCalls(FakePG):
        def allgather(self, outs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object) -> FakeWork:
            self.peers = flags if self.calls == 0 else flat
            return super().allgather(outs, inputs, opts)

    Across(TwoCalls(flags, 0), FakeManager()).sum_grads([used_here, used_there, unused])
    assert used_here.grad.tolist() == [1.0, 2.0] and used_there.grad.tolist() == [5.0, 6.0]
    assert unused.grad is None


def _cfg(*overrides: tuple[str, object]) -> object:
    base = [("fault.replica_groups", 2), ("fault.lighthouse", "localhost:29510"), ("train.global_batch", 8),
            ("log.run_dir", "runs/x")]  # fmt: skip
    return load_config(None, base + list(overrides))


def test_group_config_takes_its_share_of_the_batch_and_a_run_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlm.train.replicas import group_config, lighthouse_address

    monkeypatch.setenv("MESHLM_REPLICA_GROUP", "1")
    cfg = group_config(_cfg())
    assert cfg.train.global_batch == 4 and cfg.log.run_dir.endswith("runs/x/group-1") and cfg.train.sync_every == 1
    assert lighthouse_address(cfg) == "http://localhost:29510"


@pytest.mark.parametrize(
    ("overrides", "env", "says"),
    [
        ([("train.global_batch", 9)], {}, "train.global_batch = 9 does not split over fault.replica_groups = 2"),
        ([("train.sync_every", 4)], {}, "train.sync_every = 4: with fault.replica_groups > 1"),
        ([("parallel.zero", 1)], {}, "parallel.zero = 1 with fault.replica_groups > 1: live recovery is proven"),
        ([], {"MESHLM_REPLICA_GROUP": "2"}, "env MESHLM_REPLICA_GROUP must be this group's index 0..1, got '2'"),
        ([], {"MESHLM_REPLICA_GROUP": ""}, "env MESHLM_REPLICA_GROUP must be this group's index 0..1, got ''"),
        ([("fault.lighthouse", "")], {"TORCHFT_LIGHTHOUSE": ""}, "fault.lighthouse: the lighthouse's HOST:PORT"),
        ([], {"TORCHELASTIC_MAX_RESTARTS": "3"}, "meshlm launch --max-restarts: a replica group is relaunched"),
    ],
)
def test_group_config_refuses_in_one_line(
    monkeypatch: pytest.MonkeyPatch, overrides: list, env: dict[str, str], says: str
) -> None:
    from meshlm.train.replicas import group_config

    monkeypatch.setenv("MESHLM_REPLICA_GROUP", "0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as e:
        group_config(_cfg(*overrides))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_without_torchft_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlm.train.replicas import group_config

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ConfigError, match=r"needs torchft: pip install 'meshlm\[ft\]'"):
        group_config(_cfg())


def test_the_timeout_ladder_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"fault.quorum_timeout_s .10.0. must exceed fault.collective_timeout_s"):
        _cfg(("fault.quorum_timeout_s", 10), ("fault.collective_timeout_s", 30))


def test_lighthouse_refuses_bad_arguments_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "lighthouse", "--min-replicas", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "--min-replicas must be >= 1" in done.stderr


def test_rows_at_reads_the_stream_by_sample() -> None:
    """A group's rows at a sample position are the rows one run reads there: step k, dp rank r of world w."""
    sampler = GlobalBatchSampler(np.arange(5000) % 97, seq_len=8, global_batch=8, seed=3)
    x, y = sampler.local_batch_at(5, rank=1, world=4)
    rx, ry = sampler.rows_at(5 * 8 + 2, 2)
    assert torch.equal(x, rx) and torch.equal(y, ry)


def test_the_guard_state_travels_with_a_heal() -> None:
    source, healed = StepGuard("skip", 2.0), StepGuard("skip", 2.0)
    for loss in (1.0, 1.1, 0.9, 1.0, 1.2):
        source.allow(loss, 0.5)
    healed.load_state_dict(source.state_dict())
    assert healed.allow(2.5, 0.5) is source.allow(2.5, 0.5) is False  # a spike to both: the same window


def test_evaluation_stays_inside_the_group() -> None:
    """Every group evaluates the same batches: during `alone()` the model's token counts and losses are not
    summed across groups (N times the batch, and no quorum is held there); after it they are again. Mutation:
    `alone()` leaving `model.across` set fails the first assertion."""
    from types import SimpleNamespace

    from meshlm.train.replicas import ReplicaRun

    model = SimpleNamespace(across=None)
    run = object.__new__(ReplicaRun)  # the Manager and its process group are not needed here
    run.trainer, run.across = SimpleNamespace(model=model), Across(FakePG([torch.ones(1)], 0), FakeManager())
    model.across = run.across
    with run.alone():
        assert model.across is None
    assert model.across is run.across


def test_a_group_replaced_before_the_survivors_stepped_without_it_is_named() -> None:
    """A relaunch that joins before the survivors' next quorum keeps the dead group's index (the live list does not
    change): its new incarnation still makes the survivors name the loss in one line. Mutation: comparing group
    indices alone (the incarnation left out) prints nothing here."""
    from types import SimpleNamespace

    from meshlm.train.replicas import ReplicaRun

    said: list[str] = []
    peers = {0: 11, 1: 22, 2: 33}

    def gather(ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tensor([g, peers[g] if g != run.group else int(ids[1])]) for g in (0, 1, 2)]

    trainer = SimpleNamespace(
        sampler=SimpleNamespace(step=4), log=lambda *a, **k: None, say=lambda s, **k: said.append(s)
    )
    manager = SimpleNamespace(start_quorum=lambda: None)
    across = SimpleNamespace(gather=gather)
    run = SimpleNamespace(pace=0.0, live=None, n_groups=3, trainer=trainer, manager=manager, healed_to=None,
                          across=across, group=0, incarnation=11, incarnations={})  # fmt: skip
    ReplicaRun.start_step(run)  # the first quorum: nothing to compare with
    ReplicaRun.start_step(run)  # the same members
    assert said == [] and run.live == [0, 1, 2]
    peers[2] = 44  # group 2 killed and relaunched between two quorums
    ReplicaRun.start_step(run)
    assert said == [
        "replica groups at step 5: group 2 left (dead) and its relaunch joined; stepping with 3 of 3 (groups 0, 1, 2)"
    ]
