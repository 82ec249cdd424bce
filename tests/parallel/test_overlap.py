"""Overlapped communication (issue #51 item 4) stays exact: ZeRO-1/2's weight all-gathers are waited per
buffer where the next forward first needs them and by whatever reads the weights before that; HSDP's replicate
all-reduce travels while the backward goes on; the replica desync check catches a one-ulp difference.

The ZeRO equivalence tests (tests/parallel/test_data_parallel.py, test_expert_parallel.py) run with the
overlapped gather, which is the default; these tests pin what they cannot see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from distributed import run_shared
from dp_helpers import build
from equivalence import TEST_MODEL
from test_moe import MOE_MODEL

from meshlm.model import Transformer, preset
from meshlm.parallel.dp.gather import PendingParameter
from meshlm.parallel.engine import ParallelModel, parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.testing import global_batch
from meshlm.train.guards import TrainingFault, check_replicas_in_sync

BUCKET_MB = 0.2  # the test model's matrices fill four buffers, its vectors a fifth (as test_data_parallel)
# Rank 1 posts its weight gather this long after both ranks left the clip's all-reduce together, so rank 0's
# reads right after its own step find the gather still in flight: a read that does not wait sees the weights of
# before the step. (Only the mutations' detection depends on it: a correct read waits whatever the timing.)
LATE_GATHER_S = 2.0


def one_step(pm: ParallelModel, opt: torch.optim.Optimizer, step: int, late_rank: int | None = None) -> float:
    """One optimizer step on this replica's rows of global batch `step`; `late_rank` posts its gather late."""
    x, y = global_batch(step, 8, 32, TEST_MODEL.vocab_size)
    loss = pm.forward_backward(pm.local_batch(x), pm.local_batch(y))
    pm.clip_grad_norm_(1.0)
    opt.step()
    if dist.get_rank() == late_rank:
        time.sleep(LATE_GATHER_S)
    pm.after_optimizer_step()
    pm.zero_grad()
    return float(loss)


def _reads_right_after_step(zero: int) -> dict:
    """Rank 0 reads the weights right after its step while rank 1's gather is late: a state_dict (what a save
    of the model writes), the replica desync check, and the fp32 shards a checkpoint writes."""
    pm, opt, _ = build(TEST_MODEL, zero, BUCKET_MB)
    one_step(pm, opt, 0)
    before = {k: v.clone() for k, v in pm.chunks[0].state_dict().items()}
    one_step(pm, opt, 1, late_rank=1)
    out = {"pending": sum(isinstance(p, PendingParameter) for p in pm.chunks[0].parameters())}
    saved = {k: v.clone() for k, v in pm.chunks[0].state_dict().items()} if dist.get_rank() == 0 else None
    try:
        check_replicas_in_sync(pm)
        out["desync"] = None
    except TrainingFault as e:
        out["desync"] = str(e)
    pm.dp.settle_gathers()
    gathered = pm.chunks[0].state_dict()
    out["changed"] = all(not torch.equal(before[n], gathered[n]) for n, _ in pm.chunks[0].named_parameters())
    if saved is not None:
        out["stale"] = sorted(k for k in gathered if not torch.equal(saved[k], gathered[k]))
    full = pm.full_state_dict()  # from the fp32 shards: the weights a checkpoint writes
    out["full_matches"] = all(torch.equal(full[k], gathered[k].float()) for k in gathered)
    return out


@pytest.mark.parametrize("zero", [1, 2])
def test_a_save_right_after_a_step_reads_the_gathered_weights(zero: int) -> None:
    """Mutation: PendingParameter.__torch_function__ without its settle() makes rank 0's state_dict stale (every
    weight but the part of rank 0's own shards) and the desync check a false alarm."""
    results = run_shared(_reads_right_after_step, 2, zero)
    for result in results:
        assert result["pending"] > 0, "the weight gathers were not left in flight after the step"
        assert result["changed"] and result["full_matches"]
    assert results[0]["stale"] == [] and [r["desync"] for r in results] == [None, None]


def _waits_per_buffer() -> dict:
    """After a step every gathered weight is pending; the embedding's forward waits for its own buffer only."""
    out = {}
    for overlap in (True, False):
        pm, opt, _ = build(TEST_MODEL, 1, BUCKET_MB, overlap_gather=overlap)
        losses = [one_step(pm, opt, step) for step in range(3)]
        model = pm.chunks[0]
        pending = {n for n, p in model.named_parameters() if isinstance(p, PendingParameter)}
        model.model.embed_tokens(torch.zeros(1, 4, dtype=torch.long))
        still = {n for n, p in model.named_parameters() if isinstance(p, PendingParameter)}
        losses.append(one_step(pm, opt, 3))
        out[overlap] = {"losses": losses, "pending": pending, "after_embedding": still}
    return out


def test_each_buffer_is_waited_where_the_forward_first_needs_it() -> None:
    """Mutation: ParamGathers._pre_forward settling every buffer (one wait for all) leaves nothing pending after
    the embedding's forward; the losses with and without the overlap are the same bits."""
    out = run_shared(_waits_per_buffer, 2)[0]
    names = {n for n, _ in Transformer(TEST_MODEL).named_parameters()}
    assert out[True]["pending"] == names and out[False]["pending"] == set()
    after = out[True]["after_embedding"]
    assert "model.embed_tokens.weight" not in after and "lm_head.weight" in after
    assert "model.layers.3.mlp.down_proj.weight" in after
    assert out[True]["losses"] == out[False]["losses"]


def _replicate_all_reduces() -> list[tuple[bool, int]]:
    """For every all-reduce over the replicate group of hybrid ZeRO-2 in one step: whether it was issued
    asynchronously and how many earlier ones were still in flight then."""
    pm, opt, _ = build(TEST_MODEL, 2, BUCKET_MB, shard_group_size=2)
    replicate = pm.dp.replicate_group
    original, seen = dist.all_reduce, []

    def recording(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        if kwargs.get("group") is replicate:
            seen.append((bool(kwargs.get("async_op", False)), len(pm.dp.replicating)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        one_step(pm, opt, 0)
    finally:
        dist.all_reduce = original
    assert len(seen) == len(pm.dp.buffers)
    return seen


def test_hybrid_replicate_all_reduce_stays_in_flight() -> None:
    """Mutations: DataParallel._complete's replicate all-reduce synchronous again (`dist.all_reduce(out,
    group=groups.replicate)` then `_finish`, as before issue #51), or overlap_replicate False (each waited at
    once): no all-reduce is ever issued while another is in flight."""
    for result in run_shared(_replicate_all_reduces, 4):
        assert all(issued_async for issued_async, _ in result)
        assert [in_flight for _, in_flight in result] == list(range(len(result)))


@dataclass(eq=False)
class _Groups:
    """A reduction group's stand-in for hide_unused: only its `group` is read (and it is a dict key)."""

    group: dist.ProcessGroup


def _unused_flags() -> dict:
    """Two reduction groups, each with a buffer of two parameters: parameter 0 used on rank 0 only, parameter
    1 on no rank. Counts the host reads of the flags (tolist) in one hide_unused."""
    from meshlm.parallel.dp.unused import hide_unused
    from meshlm.parallel.dp.zero import FlatBuffer
    from meshlm.parallel.placement import Placements

    buffers, groups = [], {}
    for _ in range(2):
        params = [torch.nn.Parameter(torch.ones(2, 2)) for _ in range(2)]
        buf = FlatBuffer(params, 1, 0, torch.float32)
        buf.steps, buf.step_owner = params, [0, 1]
        for p in params:
            p.grad = torch.zeros_like(p)
        buf.used = [dist.get_rank() == 0, False]
        buffers.append(buf)
        groups[id(buf)] = _Groups(dist.group.WORLD)
    original, reads = torch.Tensor.tolist, []

    def counted(self: torch.Tensor) -> list:
        reads.append(self.numel())
        return original(self)

    torch.Tensor.tolist = counted
    try:
        hide_unused(buffers, lambda buf: groups[id(buf)], Placements())
    finally:
        torch.Tensor.tolist = original
    hidden = [[p.grad is None for p in buf.params] for buf in buffers]
    return {"reads": reads, "hidden": hidden, "reset": [buf.used for buf in buffers]}


def test_unused_flags_are_one_tensor_read_once() -> None:
    """Mutation: the flags reduced and read per reduction group (before issue #51) reads twice."""
    for result in run_shared(_unused_flags, 2):
        assert result["reads"] == [4]  # both groups' flags, one read
        assert result["hidden"] == [[False, True], [False, True]]  # used on some rank: kept; on none: hidden
        assert result["reset"] == [[False, False], [False, False]]


def _one_ulp_desync() -> str:
    torch.manual_seed(0)
    mesh = build_mesh(parse_layout("dp=2", 2), "cpu")
    model = parallelize(Transformer(preset("test")), mesh)
    check_replicas_in_sync(model)  # identical replicas pass
    weight = model.chunks[0].model.embed_tokens.weight
    if mesh.rank("dp") == 1:  # one ulp on the smallest element: a float sum of the tensor rounds it away
        with torch.no_grad():
            flat = weight.view(-1)
            i = int(flat.abs().argmin())
            flat[i] = torch.nextafter(flat[i], torch.tensor(1.0))
    try:
        check_replicas_in_sync(model)
    except TrainingFault as e:
        return str(e)
    return "no error"


def test_desync_of_one_ulp_is_caught() -> None:
    """Mutation: bit_checksum as the tensor's float sum (`t.float().sum()`) misses it ("no error")."""
    for message in run_shared(_one_ulp_desync, 2):
        assert "model.embed_tokens.weight on dp rank 1 (global rank 1)" in message


def _host_reads_in_expert_dispatch() -> dict:
    """Host reads (tolist, item, int) inside ShardedExperts.forward in one forward of an ep=2 MoE model, the
    expert loop's own excepted (its counts are checked to be a host tensor: reading it syncs nothing)."""
    from meshlm.model.moe import GroupedExperts
    from meshlm.parallel.ep.experts import ShardedExperts

    torch.manual_seed(0)
    pm = parallelize(Transformer(MOE_MODEL), build_mesh(parse_layout("ep=2", 2), "cpu"))
    state = {"in_dispatch": False, "reads": 0, "loop_counts": []}
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__int__")}
    dispatch, loop = ShardedExperts.forward, GroupedExperts.loop

    def reading(name: str):
        def read(self: torch.Tensor, *args: object) -> object:
            state["reads"] += state["in_dispatch"]
            return patched[name](self, *args)

        return read

    def counted_dispatch(self: ShardedExperts, *args: object) -> torch.Tensor:
        state["in_dispatch"] = True
        try:
            return dispatch(self, *args)
        finally:
            state["in_dispatch"] = False

    def uncounted_loop(self: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        state["loop_counts"].append(counts.device.type)
        was, state["in_dispatch"] = state["in_dispatch"], False
        try:
            return loop(self, x, counts)
        finally:
            state["in_dispatch"] = was

    for name in patched:
        setattr(torch.Tensor, name, reading(name))
    ShardedExperts.forward, GroupedExperts.loop = counted_dispatch, uncounted_loop
    try:
        x, _ = global_batch(0, 4, 16, MOE_MODEL.vocab_size)
        pm(pm.local_batch(x))
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
        ShardedExperts.forward, GroupedExperts.loop = dispatch, loop
    layers = sum(isinstance(m, ShardedExperts) for m in pm.chunks[0].modules())
    return {"reads": state["reads"], "layers": layers, "loop_counts": state["loop_counts"]}


def test_expert_dispatch_reads_the_host_once_per_layer() -> None:
    """The split sizes all_to_all_single needs as host ints are the one read; the row total and the expert
    loop's rows per expert come from it. Mutation: the dispatch before issue #51 (two tolist, int(lengths.sum())
    in expert_major_order, the loop's counts on the device) reads three times per layer."""
    for result in run_shared(_host_reads_in_expert_dispatch, 2):
        assert result["layers"] > 0 and result["reads"] == result["layers"]
        assert result["loop_counts"] == ["cpu"] * result["layers"]
