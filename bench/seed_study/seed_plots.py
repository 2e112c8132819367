"""PNG plots of the seed-comparison sweep (bench/seed_study/seed_comparison.py), per pair: throughput, P95 latency
and a mode-vs-mode throughput heatmap."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed_rows import MODE_TITLES, concurrencies, measured, mode_order, ratio, slug, table_by, value


def make_plots(doc: dict, base: Path) -> tuple[dict[str, list[str]], str | None]:
    """Per pair: throughput (loadgen's plot), P95 vs concurrency, and a mode-vs-mode heatmap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from verifypd_loadgen import plots as lg_plots
    except ImportError as exc:
        return {}, f"no plots: {exc}"
    label = doc.get("label") or ""
    written: dict[str, list[str]] = {}
    pairs = sorted({r["pair"] for r in doc["rows"]})
    for pair in pairs:
        by_mode = table_by(doc["rows"], pair)
        modes = mode_order(by_mode)
        stem = f"{base}_{slug(pair)}"
        paths = []
        series = []
        for m in modes:
            runs = [
                {"load": {"mode": "closed", "concurrency": c, "rate": None}, "summary": r["summary"]}
                for c, r in sorted(by_mode[m].items())
                if r.get("status") == "ok" and "summary" in r
            ]
            if runs:
                series.append((MODE_TITLES.get(m, m), {"runs": runs}))
        if series:
            p = lg_plots.throughput_plot(series, Path(f"{stem}_throughput.png"))
            paths.append(str(p))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for m in modes:
            pts = sorted(measured(by_mode, m, "e2e_p95_ms").items())
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=MODE_TITLES.get(m, m))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("P95 end-to-end latency (ms)")
        ax.set_title(f"{pair}: P95 latency — {label}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(f"{stem}_p95.png", dpi=110)
            paths.append(f"{stem}_p95.png")
        plt.close(fig)
        combos = [
            (a, b)
            for a, b in (
                ("pdv", "pd"),
                ("pdv", "baseline"),
                ("pd", "baseline"),
                ("pdv", "k0"),
                ("pd", "k0"),
                ("baseline", "k0"),
            )
            if a in by_mode and b in by_mode
        ]
        cs = concurrencies(by_mode)
        if combos and cs:
            grid = [
                [
                    (ratio(value(by_mode, a, c, "output_tok_s"), value(by_mode, b, c, "output_tok_s")) or math.nan) - 1
                    for c in cs
                ]
                for a, b in combos
            ]
            fig, ax = plt.subplots(figsize=(3.5 + 0.75 * len(cs), 1.6 + 0.5 * len(combos)))
            im = ax.imshow([[v * 100 for v in row] for row in grid], cmap="RdYlGn", vmin=-50, vmax=50, aspect="auto")
            ax.set_xticks(range(len(cs)), [str(c) for c in cs])
            ax.set_yticks(
                range(len(combos)), [f"{MODE_TITLES.get(a, a)} vs {MODE_TITLES.get(b, b)}" for a, b in combos]
            )
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, "–" if math.isnan(v) else f"{100 * v:+.0f}%", ha="center", va="center", fontsize=7)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{pair}: throughput improvement — {label}", fontsize=9)
            fig.colorbar(im, ax=ax, label="%")
            fig.tight_layout()
            fig.savefig(f"{stem}_heatmap.png", dpi=110)
            plt.close(fig)
            paths.append(f"{stem}_heatmap.png")
        written[pair] = paths
    return written, None
