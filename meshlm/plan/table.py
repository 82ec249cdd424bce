"""The `meshlm plan` table: its rows, the columns that fit the terminal (never so few that two rows read the
same), its legend, and the lines under it that say why the first pick beats the second and, for a mixture of
experts, when the pick drops expert parallelism."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshlm.model.config import ModelConfig
from meshlm.plan.hardware import Hardware
from meshlm.plan.network import crosses_nodes
from meshlm.plan.search import Plan
from meshlm.plan.spot import Estimate, duration_text


def si(x: float) -> str:
    """2.6e6 -> '2.6M', 7.06e10 -> '70.6B', 1.5e13 -> '15T'."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def offer(e: Estimate | None, recommended: Estimate | None) -> str:
    """'$137M, 116 d' for a table cell ('cannot finish' for a pool that never does, '—' for none); '*' marks
    the pick."""
    if e is None:
        return "—"
    if not e.feasible:
        return "cannot finish"
    return f"${si(e.usd)}, {duration_text(e.wall_s)}" + (" *" if e is recommended else "")


# The table's columns in order, and the order they are left out in when the terminal is too narrow for all.
COLUMNS = ["#", "layout", "zero", "mb", "schedule", "recompute", "sp", "GiB/GPU", "step s", "tok/s", "TFLOP/s",
           "MFU", "on demand", "spot", "mixed", "restarts", "ckpt every"]  # fmt: skip
DROP_ORDER = ["TFLOP/s", "ckpt every", "restarts", "step s", "sp", "mixed", "recompute", "spot", "mb", "zero",
              "schedule", "tok/s", "GiB/GPU"]  # fmt: skip  # never dropped: #, layout, MFU, on demand
# The columns that say what a strategy is (the rest are what it gives): two rows must differ in those shown.
STRATEGY = ("layout", "zero", "mb", "schedule", "recompute", "sp")


def row(i: int, plan: Plan) -> dict[str, str]:
    """Plan `i` (1-based) as the table's cells."""
    d = plan.to_dict()
    schedule = d["schedule"] + (f"×{d['virtual_stages']}" if d["schedule"] == "interleaved" else "")
    layout = d["layout"] + (f" {d['cp_attention']}" if d["cp_attention"] else "")
    recompute = d["recompute"] + (f" +{d['recompute_layers']} full" if d["recompute_layers"] else "")
    o = plan.offerings
    on_demand, spot, mixed = (offer(e, o.recommended) for e in (o.on_demand, o.spot, o.mixed))
    return {
        "#": str(i), "layout": layout, "zero": str(d["zero"]), "mb": str(d["micro_batch"]), "schedule": schedule,
        "recompute": recompute, "sp": "yes" if d["sequence_parallel"] else "",
        "GiB/GPU": f"{d['memory_gb_per_gpu']:.1f}", "step s": f"{d['step_time_s']:.2f}",
        "tok/s": f"{d['tokens_per_s']:,.0f}", "TFLOP/s": f"{d['tflops_per_gpu']:.3g}", "MFU": f"{d['mfu']:.1%}",
        "on demand": on_demand, "spot": spot, "mixed": mixed, "restarts": f"{o.recommended.restarts:,.0f}",
        "ckpt every": duration_text(o.recommended.interval_s),
    }  # fmt: skip


def distinct(rows: list[dict[str, str]], shown: list[str]) -> bool:
    """Whether every row's strategy cells among `shown` differ from every other row's: no two rows read the same.
    Rows that are the same strategy in every column (they cannot be told apart at any width) do not count."""
    kept = [name for name in STRATEGY if name in shown]
    whole = {tuple(r[name] for name in STRATEGY) for r in rows}
    return len({tuple(r[name] for name in kept) for r in rows}) == len(whole)


def fitted_table(title: str, rows: list[dict[str, str]], console: Console) -> tuple[Table, list[str]]:
    """The table with the columns that fit `console`'s width (the least useful left out first, but never one
    that two rows differ by alone), and the names of those left out. What still does not fit is squeezed by
    rich to the width, never printed wider."""
    dropped: list[str] = []
    while True:
        shown = [name for name in COLUMNS if name not in dropped]
        table = Table(title=title, title_justify="left")
        for name in shown:
            left = name in ("layout", "schedule", "recompute")
            table.add_column(name, justify="left" if left else "right", no_wrap=True)
        for r in rows:
            table.add_row(*(r[name] for name in shown))
        needed = console.measure(table, options=console.options.update_width(10_000)).maximum
        candidates = [
            name for name in DROP_ORDER if name not in dropped and distinct(rows, [n for n in shown if n != name])
        ]
        if needed <= console.width or not candidates:
            return table, dropped
        dropped.append(candidates[0])


def legend(table: Table, rows: list[dict[str, str]]) -> list[str]:
    """What the shown columns' short names mean (only those shown; zb1 when a row uses it)."""
    shown = {str(column.header) for column in table.columns}
    notes = {
        "mb": "mb: micro-batch size, sequences per forward/backward (train.micro_batch)",
        "sp": "sp: sequence parallelism, activations outside attention and MLP split over tp",
        "zb1": "zb1: the zero-bubble pipeline schedule (ZB-H1: weight gradients fill the bubble)",
        "mixed": "mixed: on-demand nodes plus spot nodes, the best such pool",
    }
    uses_zb1 = "schedule" in shown and any(r["schedule"] == "zb1" for r in rows)
    wanted = [key for key in notes if key in shown or (key == "zb1" and uses_zb1)]
    return [notes[key] for key in wanted]


PARTS = {
    "compute": "compute",
    "tp_comm": "tensor-parallel collectives",
    "pp_comm": "pipeline send/recv",
    "cp_comm": "context-parallel exchanges",
    "ep_comm": "expert all-to-all",
    "dp_comm": "exposed data-parallel collectives",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
}


def _where(plan: Plan, part: str, hw: Hardware) -> str:
    """' across nodes' or ' in a node' for the parts that run on one mesh dim's (or group's) links."""
    group = {"tp_comm": "tp", "pp_comm": "pp", "cp_comm": "cp", "ep_comm": "ep", "dp_comm": "replicas"}.get(part)
    if group is None:
        return ""
    return " across nodes" if crosses_nodes(plan.strategy.mesh, group, hw.gpus_per_node) else " in a node"


def why_first(plans: list[Plan], hw: Hardware) -> str | None:
    """Why #1 beats #2: the step-time part that grows most from #1 to #2 (and what #2 saves elsewhere), or,
    at equal step time, the memory or cost that ranked them."""
    if len(plans) < 2:
        return None
    one, two = plans[0].step.parts(), plans[1].step.parts()
    total = two.pop("total") - one.pop("total")
    deltas = sorted(((two.get(k, 0.0) - one.get(k, 0.0), k) for k in PARTS), reverse=True)
    if abs(total) < 1e-9 * max(one.values()):
        gib = (plans[1].memory.total - plans[0].memory.total) / 2**30
        return f"#2: the same step time; {gib:+.1f} GiB/GPU" if gib else "#2: the same step time and memory"
    worse, name = deltas[0]
    text = f"#2: {total:+.3g} s/step ({total / sum(one.values()):+.1%}): {worse:+.3g} s {PARTS[name]}"
    text += _where(plans[1], name, hw)
    better, saved = deltas[-1]
    if better < 0:
        text += f", {better:+.3g} s {PARTS[saved]}{_where(plans[1], saved, hw)}"
    return text


def expert_parallel_note(plans: list[Plan], model: ModelConfig) -> str | None:
    """For a mixture of experts picked at ep = 1: say so, and how the fastest layout with ep > 1 compares."""
    if not model.n_experts or not plans or plans[0].strategy.ep > 1:
        return None
    text = f"#1 drops expert parallelism (ep=1): every rank holds all {model.n_experts} experts (their tp share)"
    with_ep = next((p for p in plans if p.strategy.ep > 1), None)
    if with_ep is None:
        return text + "; no layout with ep > 1 fits"
    slower = with_ep.step.total / plans[0].step.total - 1
    return text + f"; the fastest with ep > 1, {with_ep.strategy.layout}, is {slower:.1%} slower per step"
