"""The seed-comparison sweep's results (bench/seed_study/seed_comparison.py): JSON output, merging partial runs (one
per pair) and the markdown report (tables per pair, ratios vs k0 and vs PD, the study's own figures
beside ours, marked as theirs, and the PASS/MISS targets) with its plots."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed_plots import make_plots
from seed_rows import LOAD_MODEL, MODE_TITLES, concurrencies, fmt, mode_order, ratio, slug, table_by, value
from seed_targets import THEIRS, check_targets, theirs_section


def output_paths(out_dir: str, device_slug: str, tag: str | None) -> dict[str, Path]:
    base = Path(out_dir) / ("seed_comparison_" + device_slug + (f"_{slug(tag)}" if tag else ""))
    return {"json": base.with_suffix(".json"), "md": base.with_suffix(".md"), "base": base}


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    from verifypd_loadgen.schema import _clean  # JSON has no inf/nan: written as strings

    tmp.write_text(json.dumps(_clean(results), indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


def merge(docs: list[dict]) -> dict:
    """One document from several partial runs (one per pair): rows, servers and skips concatenated;
    later files win for a repeated (pair, mode, concurrency)."""
    merged = {
        "sources": [
            {k: d.get(k) for k in ("command", "device", "git_revision", "date", "sweep_seconds")} for d in docs
        ],
        "device": " + ".join(sorted({d.get("device", "?") for d in docs})),
        "device_slug": "_".join(sorted({d.get("device_slug", "x") for d in docs})),
        "label": docs[0].get("label"),
        "parameters": docs[0].get("parameters"),
        "servers": [s for d in docs for s in d.get("servers", [])],
        "skipped": [],
        "rows": [],
    }
    rows = {}
    for d in docs:
        # A mode served with its lanes in processes is its own series ("pdv-split"), beside the
        # one-process rows of the same mode rather than over them.
        split = {
            (sv.get("pair"), sv.get("mode"))
            for sv in d.get("servers", [])
            if (sv.get("server_info") or {}).get("topology") == "split"
        }
        for r in d.get("rows", []):
            if (r["pair"], r["mode"]) in split:
                r = dict(r, mode=r["mode"] + "-split")
            rows[(r["pair"], r["mode"], r["concurrency"])] = r
    merged["rows"] = list(rows.values())
    measured = {r["pair"] for r in merged["rows"]}
    merged["skipped"] = [s for d in docs for s in d.get("skipped", []) if s["pair"] not in measured]
    return merged


def render_report(doc: dict, plots: dict[str, list[str]]) -> tuple[str, dict]:
    """Markdown report and the target checks per pair."""
    params = doc.get("parameters") or {}
    label = doc.get("label") or "simulated acceptance"
    lines = [f"# Seed-study comparison sweep — {doc.get('device')} — {label}", ""]
    lines += [
        f"**Every speculative row uses {label} (SIMULATED)**: random weights of the named shapes; real draft "
        f"and verify compute, each draft token kept with probability α (seeded Bernoulli), so acceptance "
        f"is the benchmark's choice, not the models'. k0 rows are plain decoding (no draft).",
        "",
    ]
    srcs = doc.get("sources") or [
        {k: doc.get(k) for k in ("command", "device", "git_revision", "date", "sweep_seconds")}
    ]
    for s in srcs:
        lines.append(
            f"- run: `{s.get('command')}` — {s.get('device')}, git {str(s.get('git_revision'))[:12]}, "
            f"{s.get('date')}, {s.get('sweep_seconds')} s"
        )
    lines += [
        f"- load: {params.get('load', LOAD_MODEL)}; prompt {params.get('prompt_tokens')} random token ids, "
        f"{params.get('max_tokens')} generated tokens per request ({params.get('sampling', 'greedy')}); "
        + (
            f"{params.get('requests_per_point')} requests per point"
            if params.get("requests_per_point")
            else f"{params.get('seconds_per_point')} s per point (requests in flight then finish)"
        )
        + "; served over gRPC Generate, measured with the loadgen library.",
        "- GPU utilisation: NVML, sampled every 100 ms during each point "
        + ("(null: NVML was not available)" if doc.get("nvml") not in (None, "ok") else "(mean / max %)."),
    ]
    lines += [
        f"- note: {n}"
        for n in ([doc["git_revision_note"]] if doc.get("git_revision_note") else []) + list(doc.get("notes") or [])
    ] + [""]
    pairs = []
    for r in doc["rows"]:
        if r["pair"] not in pairs:
            pairs.append(r["pair"])
    checks_by_pair = {}
    for pair in pairs:
        by_mode = table_by(doc["rows"], pair)
        modes = mode_order(by_mode)
        cs = concurrencies(by_mode)
        pair_label = pair.replace("->", " → ")
        lines += [f"## {pair_label} (draft → target) — {label}", ""]
        head = "| mode | " + " | ".join(f"c={c}" for c in cs) + " |"
        sep = "|---|" + "---|" * len(cs)

        def grid(title, key, digits=1, fn=None):
            nonlocal lines
            lines += [f"**{title}**", "", head, sep]  # noqa: B023
            for m in modes:  # noqa: B023
                vals = []
                for c in cs:  # noqa: B023
                    v = fn(m, c) if fn else value(by_mode, m, c, key)  # noqa: B023
                    vals.append(fmt(v, digits))
                lines.append(f"| {MODE_TITLES.get(m, m)} | " + " | ".join(vals) + " |")
            lines.append("")

        tput = lambda m, c: value(by_mode, m, c, "output_tok_s")  # noqa: B023, E731
        p95 = lambda m, c: value(by_mode, m, c, "e2e_p95_ms")  # noqa: B023, E731
        grid("Output throughput (tok/s)", "output_tok_s")
        grid("P95 end-to-end latency (ms)", "e2e_p95_ms", 0)
        grid("Throughput ÷ k0", None, 2, lambda m, c: ratio(tput(m, c), tput("k0", c)))  # noqa: B023
        grid("Throughput ÷ PD", None, 2, lambda m, c: ratio(tput(m, c), tput("pd", c)))  # noqa: B023
        grid("P95 latency ÷ PD", None, 2, lambda m, c: ratio(p95(m, c), p95("pd", c)))  # noqa: B023
        lines += [
            "**Per point**",
            "",
            "| mode | c | tok/s | E2E mean / P95 / P99 ms | TTFT P95 ms | ITL P95 ms | acceptance | mean k "
            "| GPU util % (mean/max) | ok/failed | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in modes:
            for c in cs:
                r = by_mode[m].get(c)
                if r is None:
                    continue
                if r.get("status") != "ok":
                    error = str(r.get("error"))[:160]
                    lines.append(f"| {m} | {c} | – | – | – | – | – | – | – | – | ERROR: {error} |")
                    continue
                acc = r.get("acceptance_rate")
                lines.append(
                    f"| {m} | {c} | {fmt(r['output_tok_s'])} | {fmt(r['e2e_mean_ms'], 0)} / "
                    f"{fmt(r['e2e_p95_ms'], 0)} / "
                    f"{fmt(r['e2e_p99_ms'], 0)} | {fmt(r['ttft_p95_ms'], 0)} | {fmt(r['itl_p95_ms'], 2)} | "
                    f"{'–' if acc is None else f'{acc:.3f}'} | {fmt(r.get('mean_applied_k'), 2)} | "
                    f"{fmt(r.get('gpu_util_mean_pct'))} / {fmt(r.get('gpu_util_max_pct'), 0)} | "
                    f"{r.get('requests_completed')}/{r.get('requests_failed')} | {r.get('label', '')} |"
                )
        lines.append("")
        if pair == THEIRS["pair"]:
            lines += theirs_section(by_mode, modes)
        checks = check_targets(by_mode, cs)
        checks_by_pair[pair] = checks
        lines += [f"**Targets ({pair_label}, {label})**", ""]
        lines += [f"- **{c['status']}** — {c['target']}: {c['detail']}" for c in checks]
        lines.append("")
        for p in plots.get(pair, []):
            lines.append(f"![{Path(p).stem}]({Path(p).name})")
        lines.append("")
    for s in doc.get("skipped", []):
        lines += [f"## {s['pair'].replace('->', ' → ')} — skipped", "", s["note"], ""]
    failed = [s for s in doc.get("servers", []) if s.get("status") != "ok"]
    if failed:
        lines += ["## Server errors", ""]
        for s in failed:
            lines.append(f"- {s['pair']} {s['mode']}: {s.get('error')}")
            tail = s.get("log_tail") or []
            if tail:
                lines += ["", "  ```", *["  " + t for t in tail[-8:]], "  ```"]
        lines.append("")
    lines += ["## Targets summary", ""]
    for pair, checks in checks_by_pair.items():
        for c in checks:
            lines.append(f"- {c['status']}: {pair.replace('->', ' → ')} — {c['target']}")
    lines.append("")
    return "\n".join(lines), checks_by_pair


def write_report(doc: dict, out: dict[str, Path]) -> dict:
    out["md"].parent.mkdir(parents=True, exist_ok=True)
    plots, note = make_plots(doc, out["base"])
    text, checks = render_report(doc, plots)
    if note:
        text += f"\n({note})\n"
    out["md"].write_text(text)
    print(f"report: {out['md']}")
    for pair, cs in checks.items():
        for c in cs:
            print(f"{c['status']:4s}  {pair}: {c['target']} — {c['detail']}")
    return checks
