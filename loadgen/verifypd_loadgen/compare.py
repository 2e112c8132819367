"""`verifypd-loadgen compare A.json B.json ...`: side-by-side tables and comparison plots.

The first file is the baseline; other columns show their relative change against it. Runs are
matched by load point (mode + concurrency or rate); a load point missing from a file is shown
as '-'."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from verifypd_loadgen import schema
from verifypd_loadgen.report import fmt

# (row title, path into a run summary, which direction is better)
METRICS = [
    ("requests/s", ("throughput", "requests_per_s"), "higher"),
    ("output tokens/s", ("throughput", "output_tokens_per_s"), "higher"),
    ("goodput requests/s", ("goodput", "requests_per_s"), "higher"),
    ("TTFT p50 ms", ("latency_ms", "ttft", "p50"), "lower"),
    ("TTFT p99 ms", ("latency_ms", "ttft", "p99"), "lower"),
    ("ITL/token p50 ms", ("latency_ms", "itl_token", "p50"), "lower"),
    ("ITL/token p99 ms", ("latency_ms", "itl_token", "p99"), "lower"),
    ("ITL/chunk p50 ms", ("latency_ms", "itl_chunk", "p50"), "lower"),
    ("ITL/chunk p99 ms", ("latency_ms", "itl_chunk", "p99"), "lower"),
    ("TPOT p50 ms", ("latency_ms", "tpot", "p50"), "lower"),
    ("E2E p50 ms", ("latency_ms", "e2e", "p50"), "lower"),
    ("E2E p99 ms", ("latency_ms", "e2e", "p99"), "lower"),
    ("acceptance rate", ("speculation", "acceptance_rate"), "higher"),
    ("failed requests", ("requests", "failed"), "lower"),
]


def _get(summary: dict, path: tuple[str, ...]) -> Any:
    """The value at `path` in a summary; None where a key is missing."""
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def load_key(run: dict) -> tuple:
    load = run["load"]
    return (load["mode"], load["concurrency"], str(load["rate"]))


def relative(base, value) -> float | None:
    """Relative change of value against base, in percent; None when undefined."""
    if base is None or value is None or base == 0:
        return None
    return 100.0 * (value - base) / abs(base)


def _delta_cell(base, value, better: str) -> str:
    rel = relative(base, value)
    if rel is None:
        return "-"
    good = rel > 0 if better == "higher" else rel < 0
    color = "green" if good and abs(rel) >= 0.05 else "red" if abs(rel) >= 0.05 else "white"
    return f"[{color}]{rel:+.1f}%[/{color}]"


def labels_for(paths: list[str], docs: list[dict]) -> list[str]:
    labels = [d.get("label") or Path(p).stem for p, d in zip(paths, docs, strict=True)]
    if len(set(labels)) < len(labels):  # ambiguous: fall back to the file names
        labels = [str(p) for p in paths]
    return labels


def compare_tables(paths: list[str], docs: list[dict]) -> list[Table]:
    labels = labels_for(paths, docs)
    keys: list[tuple] = []
    for d in docs:
        for r in d["runs"]:
            if load_key(r) not in keys:
                keys.append(load_key(r))
    by_key = [{load_key(r): r for r in d["runs"]} for d in docs]
    tables = []
    for key in keys:
        label = next(m[key]["load"]["label"] for m in by_key if key in m)
        t = Table(title=f"Load {label}", title_justify="left")
        t.add_column("metric")
        t.add_column(f"{labels[0]} (baseline)", justify="right")
        for lab in labels[1:]:
            t.add_column(lab, justify="right")
            t.add_column("Δ", justify="right")
        base = by_key[0].get(key)
        for title, path, better in METRICS:
            b = _get(base["summary"], path) if base else None
            row = [title, fmt(b)]
            for m in by_key[1:]:
                v = _get(m[key]["summary"], path) if key in m else None
                row += [fmt(v), _delta_cell(b, v, better)]
            t.add_row(*row)
        tables.append(t)
    return tables


def run_compare(paths: list[str], plot_dir: str | None, console: Console) -> int:
    try:
        docs = [schema.load(p) for p in paths]
    except schema.SchemaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in compare_tables(paths, docs):
        console.print(t)
    if plot_dir:
        from verifypd_loadgen import plots  # matplotlib only when plotting

        written = plots.plot_comparison(list(zip(labels_for(paths, docs), docs, strict=True)), plot_dir)
        console.print("plots: " + ", ".join(str(p) for p in written), markup=False)
    return 0
