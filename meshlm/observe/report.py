"""`meshlm report RUN_DIR`: one self-contained HTML page about a run, readable in a browser with no server.

Plots (PNG, embedded as base64) of loss, throughput, MFU, the step-time breakdown, memory and the spread over
ranks, then the environment and the config. Each plot needs only its own metrics: a run logged before some
metric existed gets the plots it can have and a note naming the rest. A resumed run is shown as its final
history (steps redone after a resume replace the earlier ones), with each resume marked on every plot;
lines of `metrics.jsonl` that do not parse are skipped and counted.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.observe.metrics import latest_timeline, load_metrics
from meshlm.observe.peak import mfu_basis

if TYPE_CHECKING:
    from matplotlib.figure import Figure

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
MEMORY_LINES = {"rss": "process RSS", "peak_allocated": "CUDA peak allocated", "reserved": "CUDA reserved"}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def _figure(title: str, ylabel: str) -> tuple[Figure, object]:
    from matplotlib.figure import Figure  # here: every `meshlm` command builds this module's parser

    fig = Figure(figsize=(8, 3.2), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def loss_plot(run: dict[str, list[dict]]) -> Figure | None:
    train, evals = run["train"], run["eval"]
    if not _series(train, "loss")[0] and not _series(evals, "loss")[0]:
        return None
    fig, ax = _figure("Loss", "cross-entropy")
    ax.plot(*_series(train, "loss"), label="train", lw=1.2)
    if evals:
        ax.plot(*_series(evals, "loss"), "o-", label="eval", lw=1.2)
    ax.legend()
    return fig


def throughput_plot(run: dict[str, list[dict]]) -> Figure | None:
    steps, tps = _series(run["train"], "tokens_per_s")
    if not steps:
        return None
    fig, ax = _figure("Throughput", "tokens / s")
    ax.plot(steps, tps, lw=1.2)
    ax.set_ylim(bottom=0)
    return fig


def mfu_plot(run: dict[str, list[dict]]) -> Figure | None:
    steps, values = _series(run["train"], "mfu")
    if not steps:
        return None
    fig, ax = _figure("Model FLOPs utilisation", "MFU (%)")
    ax.plot(steps, [100 * v for v in values], lw=1.2)
    ax.set_ylim(bottom=0)
    return fig


def breakdown_keys(train: list[dict]) -> list[str]:
    """compute, each communication kind, bubble, data wait: the parts that add up to step_time_s."""
    kinds = sorted({k for r in train for k in r if k.startswith("comm_") and k.endswith("_s") and k != "comm_s"})
    return ["compute_s", *kinds, "bubble_s", "data_wait_s"]


def breakdown_plot(run: dict[str, list[dict]]) -> Figure | None:
    records = [r for r in run["train"] if "compute_s" in r]
    if not records:
        return None
    fig, ax = _figure("Where the step time went (this rank: rank 0)", "seconds")
    keys = breakdown_keys(records)
    steps = [r["step"] for r in records]
    ax.stackplot(steps, *[[r.get(k, 0.0) for r in records] for k in keys], labels=[k[:-2] for k in keys], alpha=0.85)
    ax.plot(steps, [r["step_time_s"] for r in records], "k--", lw=0.8, label="step time")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def memory_plot(run: dict[str, list[dict]]) -> Figure | None:
    train = run["train"]
    keys = [k for k in (*MEMORY_PARTS, *MEMORY_LINES) if any(f"mem_{k}_bytes" in r for r in train)]
    if not keys:
        return None
    top = max(r.get(f"mem_{k}_bytes", 0) for r in train for k in keys)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig, ax = _figure("Memory (rank 0)", unit)
    parts = [k for k in MEMORY_PARTS if k in keys]
    records = [r for r in train if any(f"mem_{k}_bytes" in r for k in keys)]
    steps = [r["step"] for r in records]
    if parts:
        values = [[r.get(f"mem_{k}_bytes", 0) / scale for r in records] for k in parts]
        ax.stackplot(steps, *values, labels=parts, alpha=0.85)
    for key, label in MEMORY_LINES.items():
        if key in keys:
            line_steps, values = _series(records, f"mem_{key}_bytes")
            ax.plot(line_steps, [v / scale for v in values], "--", lw=1.2, label=label)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def ranks_plot(run: dict[str, list[dict]]) -> Figure | None:
    ranks = run["ranks"]
    metric = next((m for m in ("compute_s", "step_time_s") if any(f"{m}_median" in r for r in ranks)), None)
    if metric is None:
        return None
    records = [r for r in ranks if f"{metric}_median" in r]
    steps = [r["step"] for r in records]
    fig, ax = _figure(f"Spread over ranks: {metric[:-2]} (min – max band, median line)", "seconds")
    ax.fill_between(steps, [r[f"{metric}_min"] for r in records], [r[f"{metric}_max"] for r in records], alpha=0.3)
    ax.plot(steps, [r[f"{metric}_median"] for r in records], lw=1.2, label="median")
    flagged = [r for r in records if r.get("straggler_rank", -1) >= 0]
    if flagged:
        ax.plot([r["step"] for r in flagged], [r[f"{metric}_max"] for r in flagged], "rx", label="straggler")
        for r in flagged:
            ax.annotate(f"rank {r['straggler_rank']}", (r["step"], r[f"{metric}_max"]), fontsize=7, color="red")
    ax.legend(fontsize=8)
    return fig


def mark_resumes(fig: Figure, steps: list[int]) -> None:
    """A dotted vertical line at each step a run resumed from, on every axis of `fig`."""
    for ax in fig.axes:
        for step in steps:
            ax.axvline(step, color="grey", ls=":", lw=1)
            ax.text(step, 1.0, " resume", transform=ax.get_xaxis_transform(), fontsize=7, color="grey", va="top")


def steps_drawn(fig: Figure) -> set[float]:
    """The distinct steps a figure's lines and areas (stackplot, fill_between) have points at."""
    steps = {float(x) for ax in fig.axes for line in ax.lines for x in line.get_xdata()}
    for ax in fig.axes:
        for collection in ax.collections:
            steps |= {float(x) for path in collection.get_paths() for x in path.vertices[:, 0]}
    return steps


def not_plotted_note(single: dict[str, set[float]]) -> str:
    """Why plots with points at fewer than two steps are left out: a curve needs two."""
    steps = sorted({int(s) for found in single.values() for s in found})
    at = f"step {steps[0]}" if len(steps) == 1 else "no step"
    return f"Not plotted: {', '.join(single)} (metrics at {at} only; a curve needs two logged steps)."


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode()


def _median(records: list[dict], key: str) -> float | None:
    values = _series(records, key)[1]
    return statistics.median(values) if values else None


def run_mfu_basis(env: dict, config: dict) -> str:
    """What the run's MFU is a fraction of, from its env record and config (see `observe.peak.mfu_basis`)."""
    given = bool(config.get("log", {}).get("peak_flops"))
    return mfu_basis(env.get("device", "cpu"), env.get("device_name", ""), given)


def summary_rows(run: dict[str, list[dict]], mfu_of: str) -> list[tuple[str, str]]:
    train, evals, ranks = run["train"], run["eval"], run["ranks"]
    rows = []
    if train:
        rows.append(("steps logged", f"{train[0]['step']} … {train[-1]['step']} ({len(train)} records)"))
    if _series(train, "loss")[1]:
        rows.append(("final train loss", f"{_series(train, 'loss')[1][-1]:.4f}"))
    if _series(evals, "loss")[1]:
        first, last = _series(evals, "loss")[1][0], _series(evals, "loss")[1][-1]
        rows.append(("eval loss", f"{first:.4f} → {last:.4f}"))
    for key, label, fmt in (
        ("step_time_s", "median step time", "{:.3f} s"),
        ("tokens_per_s", "median throughput", "{:,.0f} tokens/s"),
        ("mfu", f"median MFU (of {mfu_of})", "{:.2%}"),
    ):
        value = _median(train, key)
        if value is not None:
            rows.append((label, fmt.format(value)))
    timed = [r for r in train if "compute_s" in r]
    if timed:
        total = sum(r["step_time_s"] for r in timed)
        shares = [f"{k[:-2]} {sum(r.get(k, 0.0) for r in timed) / total:.1%}" for k in breakdown_keys(timed)]
        rows.append(("time breakdown (rank 0)", ", ".join(shares)))
    for key in (*MEMORY_PARTS, *MEMORY_LINES):
        peak = max((r[f"mem_{key}_bytes"] for r in train if f"mem_{key}_bytes" in r), default=None)
        if peak is not None:
            rows.append((f"memory: {MEMORY_LINES.get(key, key)}", f"{peak / 2**20:,.1f} MiB"))
    flagged = sorted({int(r["straggler_rank"]) for r in ranks if r.get("straggler_rank", -1) >= 0})
    if ranks:
        rows.append(("stragglers", ", ".join(f"rank {r}" for r in flagged) or "none flagged"))
    if run["fault"]:
        rows.append(("skipped updates", ", ".join(f"step {r['step']}" for r in run["fault"])))
    if run["resume"]:
        rows.append(("resumed at", ", ".join(f"step {r['step']}" for r in run["resume"])))
    failed = [r for r in run["checkpoint"] if r.get("status") == "failed"]
    if failed:
        rows.append(("failed checkpoint saves", "; ".join(f"step {r['step']}: {r.get('error', '?')}" for r in failed)))
    return rows


def skipped_lines_note(bad_lines: list[int]) -> str:
    """'3 unreadable lines skipped (lines 4, 9, 12)', the first ten numbered."""
    shown = ", ".join(map(str, bad_lines[:10])) + (", …" if len(bad_lines) > 10 else "")
    plural = "s" if len(bad_lines) > 1 else ""
    return f"{len(bad_lines)} unreadable line{plural} skipped (line{plural} {shown})"


def environment_rows(env: dict, config: dict, ranks: list[dict]) -> list[tuple[str, str]]:
    """From the run's env record; what it lacks (older runs) from the config and the rank summaries."""
    values = {k: v for k, v in env.items() if k not in ("step", "kind", "time")}
    values.setdefault("device", config.get("train", {}).get("device", "unknown"))
    values.setdefault("layout", config.get("parallel", {}).get("layout", "unknown") or "world as dp")
    if ranks:
        values.setdefault("world_size", ranks[-1].get("n_ranks", "unknown"))
    model = config.get("model", {})
    if model.get("preset"):
        values["model preset"] = model["preset"]
    return [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in values.items() if v != ""]


PLOTS: tuple[tuple[str, str, Callable[[dict[str, list[dict]]], Figure | None]], ...] = (
    ("Loss", "loss of each logged training step, and the validation loss", loss_plot),
    ("Throughput", "tokens of the global batch per second of step time", throughput_plot),
    ("MFU", "model FLOPs per second over the {mfu_of} of all devices (docs/observability.md)", mfu_plot),
    ("Time breakdown", "compute, exposed communication by kind, pipeline bubble and data wait", breakdown_plot),
    ("Memory", "tensor bytes by category (stacked) and the process / allocator totals", memory_plot),
    ("Ranks", "min / median / max over ranks at each aggregation step; stragglers marked", ranks_plot),
)

STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0}td{padding:2px 12px 2px 0;vertical-align:top}
td:first-child{color:#555}img{max-width:100%}pre{background:#f4f4f4;padding:1em;overflow-x:auto}
.note{color:#777}h2{margin-top:1.6em;border-bottom:1px solid #ddd}"""


def _table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def render(run_dir: Path) -> str:
    """The HTML page of a run directory (metrics.jsonl, config.toml)."""
    records, bad_lines = load_metrics(run_dir)
    records = latest_timeline(records)
    kinds = ("train", "eval", "ranks", "env", "fault", "resume", "checkpoint")
    run = {kind: [r for r in records if r["kind"] == kind] for kind in kinds}
    resumes = [r["step"] for r in run["resume"]]
    config_path = run_dir / "config.toml"
    config_text = config_path.read_text() if config_path.is_file() else ""
    try:
        config = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError:
        config = {}
    env = run["env"][-1] if run["env"] else {}
    mfu_of = run_mfu_basis(env, config)
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>meshlm run {html.escape(run_dir.name)}</title>",
        f"<style>{STYLE}</style></head><body><h1>meshlm run <code>{html.escape(str(run_dir))}</code></h1>",
        "<h2>Summary</h2>",
        _table(summary_rows(run, mfu_of) + ([("metrics.jsonl", skipped_lines_note(bad_lines))] if bad_lines else [])),
    ]
    missing, single = [], {}
    for title, caption, plot in PLOTS:
        fig = plot(run)
        if fig is None:
            missing.append(title)
            continue
        if len(steps := steps_drawn(fig)) < 2:  # one point draws no line, one step no area: an empty frame
            single[title] = steps
            continue
        caption = caption.format(mfu_of=mfu_of)
        mark_resumes(fig, resumes)
        if resumes:
            caption += "; dotted lines: resumes"
        parts.append(f"<h2>{title}</h2><p class='note'>{caption}</p><img alt='{title}' src='data:image/png;base64,")
        parts.append(_png(fig) + "'>")
    if single:
        parts.append(f"<p class='note'>{html.escape(not_plotted_note(single))}</p>")
    if missing:
        parts.append(f"<p class='note'>Not logged in this run: {', '.join(missing)}.</p>")
    parts += ["<h2>Environment</h2>", _table(environment_rows(env, config, run["ranks"]))]
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(config_text) or 'config.toml not found'}</pre>"]
    parts.append("</body></html>\n")
    return "".join(parts)


def build_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report (default RUN_DIR/report.html) and return its path."""
    run_dir = Path(run_dir)
    out = out or run_dir / "report.html"
    out.write_text(render(run_dir))
    return out


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `report` on a subparsers object."""
    p = subparsers.add_parser("report", help="write a self-contained HTML report of a run")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, help="output file (default RUN_DIR/report.html)")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(f"meshlm report: {args.run_dir}/metrics.jsonl not found (not a meshlm run directory?)", file=sys.stderr)
        return 2
    bad_lines = load_metrics(args.run_dir)[1]
    if bad_lines:
        print(f"meshlm report: {args.run_dir}/metrics.jsonl: {skipped_lines_note(bad_lines)}", file=sys.stderr)
    print(f"report written to {build_report(args.run_dir, args.out)}")
    return 0
