"""Collectives as NCCL runs them (meshlm.plan.network.nccl_algorithms / nccl_pick / group_time): every expected
figure below is worked out by hand from NCCL's cost model as docs/planner.md states it (a base latency per
algorithm, a latency per hop by link, the bytes at the algorithm's bandwidth; NCCL runs the least), never
read back from the code. Mutations that fail these tests: counting every ring hop at the network's latency
(the 2-node ring), dropping the tree (the 512-replica bucket picks ring and costs ~14 ms), tree latency linear
in the nodes (the log test), no NVLS (the H100 node test), no PAT (the one-rank-per-node gather)."""

from __future__ import annotations

import math

import pytest

from meshlm.parallel.mesh import Layout
from meshlm.parallel.options import ParallelOptions
from meshlm.plan import Candidate, Workload, hardware, step_time
from meshlm.plan.hardware import Link
from meshlm.plan.network import (
    NCCL_BASE,
    NCCL_HOP,
    TREE_BANDWIDTH,
    group_time,
    nccl_algorithms,
    nccl_pick,
)

NVLINK = Link(3e-6, 360e9)
NET = Link(8e-6, 45e9)  # one 400 Gb/s NIC per rank at 0.9
US = 1e-6


def test_ring_pays_network_latency_only_on_the_hops_that_cross_nodes():
    """16 ranks on 2 nodes of 8: an all-reduce's ring has 2·15 hops, 2·1 of them between the nodes."""
    t = nccl_algorithms("all_reduce", 0.0, 16, 8, NVLINK, NET)["ring"]
    assert t == pytest.approx(8.4 * US + 28 * 3.4 * US + 2 * 14 * US)
    gather = nccl_algorithms("all_gather", 0.0, 16, 8, NVLINK, NET)["ring"]
    assert gather == pytest.approx(8.4 * US + 14 * 3.4 * US + 1 * 14 * US)


def test_bucket_over_512_replicas_runs_a_tree_not_a_ring():
    """The issue's case: a 25 MB gradient bucket all-reduced over 512 replicas, one per node (tp = 8). The
    ring pays 2·511 network hops, 14.3 ms of latency alone; the tree 2·log2(512) = 18, 0.26 ms; its bandwidth
    term (M / 0.45β) is 1.11× the ring's, so the tree is the pick."""
    m = 25e6
    ring = 8.4 * US + 2 * 511 * 14 * US + 2 * 511 / 512 * m / NET.beta
    tree = 8.4 * US + 2 * (0 * 4 * US + 9 * 14 * US) + m / (0.45 * NET.beta)
    times = nccl_algorithms("all_reduce", m, 512, 1, NVLINK, NET)
    assert times["ring"] == pytest.approx(ring) and times["tree"] == pytest.approx(tree)
    assert nccl_pick("all_reduce", m, 512, 1, NVLINK, NET) == ("tree", pytest.approx(tree))
    assert ring > 10 * tree


def test_tree_latency_grows_with_log_of_the_nodes():
    """Doubling the nodes adds one level to the tree: two network hops (up and down)."""
    t = [nccl_algorithms("all_reduce", 0.0, n, 8, NVLINK, NET)["tree"] for n in (8 * 512, 8 * 1024)]
    assert t[1] - t[0] == pytest.approx(2 * NCCL_HOP["net"])
    base = NCCL_BASE["tree"] + 2 * (7 * NCCL_HOP["nvlink"]["tree"] + 9 * NCCL_HOP["net"])
    assert t[0] == pytest.approx(base)


def test_ring_tree_crossover_at_the_size_where_their_times_meet():
    """4 nodes, one rank each: the tree's latency is lower (2·2 against 2·3 network hops), its bandwidth
    term higher (1/0.45 against 2·3/4 per β), so NCCL picks the tree below M* = ΔL / Δ(1/bandwidth) and the
    ring above it (1.75 MB here)."""
    ring_lat = NCCL_BASE["ring"] + 6 * NCCL_HOP["net"]
    tree_lat = NCCL_BASE["tree"] + 2 * math.log2(4) * NCCL_HOP["net"]
    crossover = (ring_lat - tree_lat) / (1 / (TREE_BANDWIDTH * NET.beta) - 1.5 / NET.beta)
    assert 1.5e6 < crossover < 2e6
    assert nccl_pick("all_reduce", 0.9 * crossover, 4, 1, NVLINK, NET).name == "tree"
    assert nccl_pick("all_reduce", 1.1 * crossover, 4, 1, NVLINK, NET).name == "ring"
    times = nccl_algorithms("all_reduce", crossover, 4, 1, NVLINK, NET)
    assert times["ring"] == pytest.approx(times["tree"])


def test_inside_a_node_rings_beat_trees_and_nvls_wins_large_all_reduces():
    """In one node the tree is a chain (7 hops of 4 µs each way) against the ring's 14 of 3.4 µs, and
    moves its bytes slower: the ring wins at every size. NVLS (H100) pays 23 + 25 = 48 µs of latency, less
    than the ring's 8.4 + 14·3.4 = 56 µs in the Simple protocol (the small-message LL protocols are not
    modelled), and moves the bytes 480/370 faster at 8 GPUs (nvls_speedup): it wins at every size."""
    for m in (1e3, 1e6, 1e9):
        assert nccl_pick("all_reduce", m, 8, 8, NVLINK, NET).name == "ring"
        assert nccl_pick("all_reduce", m, 8, 8, NVLINK, NET, nvls=True).name == "nvls"
    big = nccl_pick("all_reduce", 256e6, 8, 8, NVLINK, NET, nvls=True)
    assert big.name == "nvls"
    assert big.seconds == pytest.approx(48 * US + 2 * 7 / 8 * 256e6 / (480 / 370 * NVLINK.beta))
    assert "nvls" not in nccl_algorithms("all_reduce", 256e6, 16, 8, NVLINK, NET, nvls=True)  # one node only
    assert "nvls" not in nccl_algorithms("all_gather", 256e6, 8, 8, NVLINK, NET, nvls=True)


def test_gathers_with_one_rank_per_node_run_pat():
    """All-gather and reduce-scatter have no tree; with one rank per node NCCL 2.23's PAT takes log2(n)
    network hops instead of the ring's n − 1."""
    t = nccl_algorithms("reduce_scatter", 25e6, 128, 1, NVLINK, NET)
    assert t["pat"] == pytest.approx(8.4 * US + 7 * 14 * US + 127 / 128 * 25e6 / NET.beta)
    assert t["ring"] - t["pat"] == pytest.approx((127 - 7) * 14 * US)
    assert "pat" not in nccl_algorithms("reduce_scatter", 25e6, 128, 8, NVLINK, NET)
    assert nccl_algorithms("all_gather", 25e6, 1, 1, NVLINK, NET) == {"ring": 0.0}


def test_group_time_uses_nccl_on_table_gpus_and_the_fit_where_measured():
    """A table GPU prices a data-parallel bucket with NCCL's pick over the NICs the group drives; a measured
    link (calibration) or cpu keeps the α–β ring it was fitted as."""
    h100 = hardware("H100-SXM")
    inter = h100.link("dp", True, "all_reduce", 1)
    expected = nccl_pick("all_reduce", 25e6, 512, 1, h100.intra, inter, True).seconds
    assert group_time(h100, "dp", True, "all_reduce", 25e6, 512, 1) == expected
    fit = {"alpha_s": 1e-5, "beta_Bps": 4e10}
    measured = hardware("H100-SXM", {"device": "H100-SXM", "links": {"inter": {"all_reduce": fit}}})
    ring = 2 * 511 * 1e-5 + 2 * 511 / 512 * 25e6 / 4e10
    assert group_time(measured, "dp", True, "all_reduce", 25e6, 512, 1) == pytest.approx(ring)


def test_data_parallel_time_barely_grows_from_16_to_2048_replicas():
    """Llama 3 8B at tp 8, ZeRO-1, a fixed batch per replica: with the tree and PAT the exposed
    data-parallel time grows by less than a millisecond per doubling's log step, where rings' (n − 1)·α
    per bucket would add seconds at 2,048 replicas."""
    from meshlm.model.config import preset

    model = preset("llama3-8b")
    dp_times = []
    for dp in (16, 2048):
        w = Workload(model, 8192, 4 * dp, 1e12, name="llama3-8b")
        s = Candidate(Layout(dp=dp, tp=8), ParallelOptions(zero=1, sequence_parallel=True), micro_batch=1)
        dp_times.append(step_time(w, s, hardware("H100-SXM")).dp_comm)
    assert dp_times[1] - dp_times[0] < 0.05 * dp_times[0] + 0.01


def test_nvls_speeds_up_only_groups_of_five_or_more():
    """NVLS's measured bus bandwidth (NVIDIA/nccl#1455, 8×H100): the ring's 370 GB/s for 2–4 GPUs, 420–480
    for 5–8. A 4-GPU all-reduce then gains nothing from NVLS and pays its 48 µs latency against the ring's
    8.4 + 6·3.4 µs: the ring wins at every size; at 8 GPUs NVLS moves 1 GB 480/370 faster. Fails if NVLS
    keeps one speed-up for every group size (the 4-GPU pick becomes NVLS at 1 GB)."""
    for m in (1e6, 1e9):
        assert nccl_pick("all_reduce", m, 4, 4, NVLINK, NET, nvls=True).name == "ring"
    t = nccl_algorithms("all_reduce", 1e9, 6, 6, NVLINK, NET, nvls=True)["nvls"]
    assert t == pytest.approx(48 * US + 2 * 5 / 6 * 1e9 / (440 / 370 * NVLINK.beta))
