"""Human-facing output: live progress, summary tables, CSV."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from verifypd_loadgen.metrics import LATENCY_METRICS, PERCENTILES

METRIC_TITLES = {
    "ttft": "TTFT",
    "itl_token": "ITL (per token)",
    "itl_chunk": "ITL (per chunk)",
    "tpot": "TPOT",
    "e2e": "E2E latency",
}


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


class LiveProgress:
    """A rich progress bar per load point (requests done of N, or seconds of the duration)."""

    def __init__(self, console: Console, enabled: bool):
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            # rendering holds the GIL and can delay our timestamps a
            # little: keep it rare (--no-progress for none at all)
            refresh_per_second=4,
        )
        self.task: TaskID | None = None
        self.done = self.errors = self.in_flight = 0
        self.n: int | None = None
        self.duration: float | None = None
        self.t0 = 0.0

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()

    def start_point(self, label: str, n: int | None, duration: float | None) -> None:
        self.done = self.errors = self.in_flight = 0
        self.duration, self.t0 = duration, time.monotonic()
        if self.enabled:
            self.n = n
            total = n if n is not None else duration
            self.task = self.progress.add_task(label, total=total, status="", count="")

    def on_send(self) -> None:
        self.in_flight += 1

    def on_record(self, rec) -> None:
        self.in_flight -= 1
        self.done += 1
        self.errors += 0 if rec.ok else 1
        self.refresh()

    def refresh(self) -> None:
        if not self.enabled or self.task is None:
            return
        status = f"done {self.done}  err {self.errors}  in-flight {self.in_flight}"
        if self.duration is not None:
            elapsed = min(self.duration, time.monotonic() - self.t0)
            self.progress.update(
                self.task, completed=elapsed, status=status, count=f"{elapsed:.0f}/{self.duration:g} s"
            )
        else:
            self.progress.update(self.task, completed=self.done, status=status, count=f"{self.done}/{self.n} req")


CLIENT_BUSY = 0.9  # CPU / wall of a client process above which the report warns


def print_summary(console: Console, runs: list[dict]) -> None:
    slo = any(r["summary"]["goodput"]["requests_per_s"] is not None for r in runs)
    t = Table(title="Throughput", title_justify="left")
    cols = ["load", "ok", "err", "time s", "req/s", "out tok/s"]
    cols += ["good req/s", "in SLO"] if slo else []
    cols += ["accept", "tok/msg", "client cpu"]
    for col in cols:
        t.add_column(col, justify="left" if col == "load" else "right", no_wrap=True)
    for run in runs:
        s = run["summary"]
        row = [
            run["load"]["label"],
            fmt(s["requests"]["completed"]),
            fmt(s["requests"]["failed"] + s["requests"]["cancelled"]),
            fmt(s["duration_s"]),
            fmt(s["throughput"]["requests_per_s"]),
            fmt(s["throughput"]["output_tokens_per_s"], 1),
        ]
        if slo:
            g = s["goodput"]
            row += [fmt(g["requests_per_s"]), "-" if g["fraction"] is None else f"{100 * g['fraction']:.1f}%"]
        acc = s["speculation"]["acceptance_rate"]
        row += ["-" if acc is None else f"{100 * acc:.1f}%", fmt(s["speculation"]["tokens_per_chunk"]["mean"])]
        cpu = s["client"]["cpu_util_max"]
        row += ["-" if cpu is None else f"{s['client']['procs']}x {100 * cpu:.0f}%"]
        t.add_row(*row)
    console.print(t)
    busy = [r["load"]["label"] for r in runs if (r["summary"]["client"]["cpu_util_max"] or 0) > CLIENT_BUSY]
    if busy:
        console.print(
            f"warning: a client process used > {100 * CLIENT_BUSY:.0f}% of a core at {', '.join(busy)}: "
            "the client may be the bottleneck there (more --procs)",
            markup=False,
        )

    lt = Table(title="Latency (ms)", title_justify="left")
    for col in ("load", "metric", "mean") + tuple(f"p{p}" for p in PERCENTILES) + ("max",):
        lt.add_column(col, justify="right" if col not in ("load", "metric") else "left", no_wrap=True)
    for run in runs:
        for i, m in enumerate(LATENCY_METRICS):
            st = run["summary"]["latency_ms"][m]
            lt.add_row(
                run["load"]["label"] if i == 0 else "",
                METRIC_TITLES[m],
                fmt(st["mean"]),
                *(fmt(st[f"p{p}"]) for p in PERCENTILES),
                fmt(st["max"]),
                end_section=i == len(LATENCY_METRICS) - 1,
            )
    console.print(lt)

    errs = [(r["load"]["label"], code, n) for r in runs for code, n in r["summary"]["errors"].items()]
    if errs:
        et = Table(title="Errors by status code", title_justify="left")
        for col in ("load", "code", "count"):
            et.add_column(col)
        for load_label, code, n in errs:
            et.add_row(load_label, code, str(n))
        console.print(et)


CSV_FIELDS = [
    "label",
    "mode",
    "concurrency",
    "rate",
    "sent",
    "completed",
    "failed",
    "cancelled",
    "duration_s",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "goodput_requests_per_s",
    "goodput_fraction",
    "acceptance_rate",
] + [f"{m}_{k}_ms" for m in LATENCY_METRICS for k in ("mean",) + tuple(f"p{p}" for p in PERCENTILES)]


def csv_rows(doc: dict) -> list[dict]:
    rows = []
    for run in doc["runs"]:
        s, load = run["summary"], run["load"]
        row = {
            "label": doc.get("label") or "",
            "mode": load["mode"],
            "concurrency": load["concurrency"],
            "rate": load["rate"],
            **{k: s["requests"][k] for k in ("sent", "completed", "failed", "cancelled")},
            "duration_s": s["duration_s"],
            **{k: s["throughput"][k] for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")},
            "goodput_requests_per_s": s["goodput"]["requests_per_s"],
            "goodput_fraction": s["goodput"]["fraction"],
            "acceptance_rate": s["speculation"]["acceptance_rate"],
        }
        for m in LATENCY_METRICS:
            for k in ("mean",) + tuple(f"p{p}" for p in PERCENTILES):
                row[f"{m}_{k}_ms"] = s["latency_ms"][m][k]
        rows.append(row)
    return rows


def write_csv(doc: dict, path: str | Path) -> None:
    """One row per load point; empty cells where a value is undefined."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in csv_rows(doc):
            w.writerow({k: "" if v is None else v for k, v in row.items()})
