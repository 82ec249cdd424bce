"""The planner's calibration (schema version 1, `meshlm.plan.Calibration`, docs/planner.md) from a doctor report."""

from __future__ import annotations

import statistics
import time

from meshlm.observe.bandwidth import OPS, GiB


def planner_device(report: dict) -> str:
    """The planner's name for this device (its GPU table), or the CUDA name when it has none."""
    if report["device"] == "cpu":
        return "cpu"
    name, memory = report["ranks"][0]["device_name"], report["ranks"][0]["memory_bytes"] or 0
    for key, planner_name in (("H200", "H200"), ("H100", "H100-SXM")):
        if key in name:
            return planner_name
    if "A100" in name:
        return "A100-80GB" if memory > 60 * GiB else "A100-40GB"
    return name


def cpu_machine(ranks: list[dict]) -> dict:
    """One host's figures from its R ranks: the machine's matmul rate with every core busy (R × the per-rank
    rate while all multiplied with enough threads to fill the cores), and its effective `cores`: that rate
    over one thread's rate alone, between 1 and the cores the process may use (fewer than those when the
    machine is shared with other work or its virtual CPUs are not all there). Memory bandwidth, measured by
    R ranks of `threads` threads each, is scaled by max(R, cores/threads) to all cores. The host overheads are
    single-threaded work, slowed by max(1, R/cores) while R ranks ran them at once: divided by that, they are
    what one rank pays with a core to itself."""
    busy = len(ranks)
    machine = statistics.median(r["matmul_shared_flops"] for r in ranks) * busy
    alone = max(r["matmul_alone_flops"] or 0.0 for r in ranks) or machine
    cores = min(max(1.0, machine / alone), float(statistics.median(r["cores"] for r in ranks)))
    threads = statistics.median(r["threads"] for r in ranks)
    out = {
        "cores": cores,
        "matmul_flops": machine,
        "memory_bw": statistics.median(r["memory_bw"] for r in ranks) * max(busy, cores / threads),
    }
    for name in ("layer_overhead_s", "micro_batch_overhead_s"):
        out[name] = statistics.median(r[name] for r in ranks) / max(1.0, busy / cores)
    return out


def calibration(report: dict) -> dict:
    """The doctor report in the planner's calibration schema (version 1, docs/planner.md).

    α–β per op per mesh dim (the median over that dim's groups, flagged slow ones left out) and per link kind
    (`intra` when every group of a dim stays on one host, else `inter`; from the largest such dim). Device
    figures per GPU are the median rank's. On CPU they are the whole machine's with every core busy
    (`cpu_machine`). The whole report goes under `notes` (not interpreted)."""
    ranks = report["ranks"]
    hosts = {r["rank"]: r["host"] for r in ranks}
    cal: dict = {"version": 1, "device": planner_device(report)}
    if report["device"] == "cpu":
        machines = [cpu_machine([r for r in ranks if r["host"] == h]) for h in dict.fromkeys(hosts.values())]
        for name in machines[0]:
            cal[name] = statistics.median(m[name] for m in machines)
    else:
        for name in ("matmul_flops", "memory_bw", "memory_bytes"):
            cal[name] = float(statistics.median(r[name] for r in ranks))
        cal["gpus_per_node"] = max(sum(1 for r in ranks if r["host"] == h) for h in set(hosts.values()))
        for name in ("layer_overhead_s", "micro_batch_overhead_s"):
            if all(name in r for r in ranks):
                cal[name] = float(statistics.median(r[name] for r in ranks))
    cal["framework_bytes"] = float(statistics.median(r["framework_bytes"] for r in ranks))
    dims: dict[str, dict] = {}
    kinds: dict[str, tuple[int, str]] = {}  # link kind -> (size, dim) of the largest dim of that kind
    for dim in dict.fromkeys(r["dim"] for r in report["collectives"]):
        rows = [r for r in report["collectives"] if r["dim"] == dim]
        dims[dim] = {}
        for op in OPS:
            fits = [r for r in rows if r["op"] == op and not r["slow"]] or [r for r in rows if r["op"] == op]
            dims[dim][op] = {
                "alpha_s": statistics.median(r["alpha_s"] for r in fits),
                "beta_Bps": statistics.median(r["beta_Bps"] for r in fits),
            }
        size = max(len(r["group"]) for r in rows)
        kind = "inter" if any(len({hosts[g] for g in r["group"]}) > 1 for r in rows) else "intra"
        if size > kinds.get(kind, (0, ""))[0]:
            kinds[kind] = (size, dim)
    cal["links"] = {kind: dims[dim] for kind, (_, dim) in kinds.items()}
    cal["dims"] = dims
    cal["notes"] = {"source": "meshlm doctor", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **report}
    return cal
