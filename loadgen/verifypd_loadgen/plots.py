"""PNG plots (matplotlib, Agg backend): load curves, latency percentiles, CDFs."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
import numpy as np

from verifypd_loadgen.report import METRIC_TITLES

LAT_PLOTTED = ("ttft", "itl_token", "itl_chunk", "e2e")


def _x(run: dict) -> float:
    load = run["load"]
    x = load["concurrency"] if load["mode"] == "closed" else load["rate"]
    try:
        x = float(x)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan  # an infinite rate has no place on the axis


def _xlabel(docs: list[dict]) -> str:
    modes = {r["load"]["mode"] for d in docs for r in d["runs"]}
    if modes == {"closed"}:
        return "concurrency (requests in flight)"
    if modes == {"open"}:
        return "offered rate (requests/s)"
    return "load (concurrency or requests/s)"


def _summary_value(summary: dict, path: tuple[str, ...]):
    for key in path:
        summary = summary[key]
    return summary


def _series(doc: dict, *path: str) -> tuple[list[float], list[float]]:
    """(x, y) of every run of `doc`, sorted by x; y is the summary's value at `path` (NaN for None)."""
    pts = sorted((_x(r), _summary_value(r["summary"], path)) for r in doc["runs"])
    xs = [p[0] for p in pts]
    ys = [math.nan if p[1] is None else p[1] for p in pts]
    return xs, ys


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_plot(series: list[tuple[str, dict]], path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, doc in series:
        xs, ys = _series(doc, "throughput", "output_tokens_per_s")
        ax1.plot(xs, ys, marker="o", label=label)
        xs, ys = _series(doc, "throughput", "requests_per_s")
        (line,) = ax2.plot(xs, ys, marker="o", label=f"{label} throughput")
        xs, ys = _series(doc, "goodput", "requests_per_s")
        if not all(math.isnan(y) for y in ys):
            ax2.plot(xs, ys, marker="s", linestyle="--", color=line.get_color(), label=f"{label} goodput")
    ax1.set_title("Output token throughput")
    ax1.set_ylabel("tokens/s")
    ax2.set_title("Request throughput")
    ax2.set_ylabel("requests/s")
    for ax in (ax1, ax2):
        ax.set_xlabel(_xlabel([d for _, d in series]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def latency_plot(series: list[tuple[str, dict]], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for ax, metric in zip(axes.flat, LAT_PLOTTED, strict=True):
        for label, doc in series:
            color = None
            for pct, style in styles.items():
                xs, ys = _series(doc, "latency_ms", metric, pct)
                (line,) = ax.plot(
                    xs, ys, marker="o", linestyle=style, color=color, label=f"{label} {pct}" if len(series) > 1 else pct
                )
                color = line.get_color()
        ax.set_title(METRIC_TITLES[metric])
        ax.set_ylabel("ms")
        ax.set_xlabel(_xlabel([d for _, d in series]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def cdf_plot(curves: list[tuple[str, list[float]]], title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, values in curves:
        if not values:
            continue
        v = np.sort(np.asarray(values))
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
    ax.set_title(f"CDF of {title}")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples ≤ x")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_results(doc: dict, samples: list[dict[str, list[float]]], outdir: str | Path) -> list[Path]:
    """Plots of one results document; samples[i] are the raw latency samples of runs[i]."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    label = doc.get("label") or "run"
    paths = [throughput_plot([(label, doc)], out / "throughput.png"), latency_plot([(label, doc)], out / "latency.png")]
    for metric, name in (
        ("ttft", "cdf_ttft.png"),
        ("itl_token", "cdf_itl_token.png"),
        ("itl_chunk", "cdf_itl_chunk.png"),
    ):
        curves = [(run["load"]["label"], s[metric]) for run, s in zip(doc["runs"], samples, strict=True)]
        paths.append(cdf_plot(curves, METRIC_TITLES[metric], out / name))
    return paths


# CDFs `compare` draws from per-request records (--raw-records): file name -> record field.
RECORD_CDFS = {
    "compare_cdf_ttft.png": ("ttft", "ttft_ms"),
    "compare_cdf_itl_chunk.png": ("itl_chunk", "itl_chunk_ms"),
    "compare_cdf_e2e.png": ("e2e", "e2e_ms"),
}


def plot_comparison(series: list[tuple[str, dict]], outdir: str | Path) -> list[Path]:
    """Throughput and latency vs load; plus CDFs (one curve per file and load point) when the
    files carry per-request records (`--raw-records`; files without them are left out)."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [throughput_plot(series, out / "compare_throughput.png"), latency_plot(series, out / "compare_latency.png")]
    with_records = [(label, doc) for label, doc in series if all("records" in r for r in doc["runs"])]
    if not with_records:
        return paths
    for name, (metric, field) in RECORD_CDFS.items():
        curves = []
        for label, doc in with_records:
            for run in doc["runs"]:
                ok = [r for r in run["records"] if r["ok"]]
                values = (
                    [v for r in ok for v in r[field]]
                    if field == "itl_chunk_ms"
                    else [r[field] for r in ok if r[field] is not None]
                )
                curves.append((f"{label} {run['load']['label']}", values))
        paths.append(cdf_plot(curves, METRIC_TITLES[metric], out / name))
    return paths
