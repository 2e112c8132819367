"""The seed study's own figures and the issue's PASS/MISS targets, checked over one pair's rows of the
seed-comparison sweep (bench/seed_study/seed_comparison.py). The study's figures are theirs, never measured here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed_rows import MODE_TITLES, measured, value

# The study's own figures: A100, real weights, their code. NOT measured here; shown beside ours only.
THEIRS = {
    "source": "the seed study (A100, real TinyLlama-1.1B -> Llama-2-7B weights, their code)",
    "pair": "tinyllama-1.1b->llama-2-7b",
    "peak_throughput": {"pd": (13.12, 16), "pdv": (12.75, 64)},  # tok/s at concurrency
    "p95_concurrency": (1, 5, 20, 50),
    "p95_ms": {
        "baseline": (6695, 33078, 113624, 361680),
        "pd": (6423, 33879, 123209, 368157),
        "pdv": (6341, 35639, 95711, 235652),
    },
}


PDV_MODES = ("pdv", "pdv-split")  # pdv in one process; pdv with its lanes in processes (serve --topology split)


def check_targets(by_mode: dict[str, dict[int, dict]], concurrency: list[int]) -> list[dict]:
    """The issue's targets over one pair's rows: status PASS / MISS / N/A (no data) and the detail;
    checked for each PDV variant measured (one process, split)."""
    checks = []
    for pdv in [m for m in PDV_MODES if m in by_mode] or ["pdv"]:
        checks += _checks(by_mode, concurrency, pdv)
    return checks


def _checks(by_mode: dict[str, dict[int, dict]], concurrency: list[int], pdv: str) -> list[dict]:
    name = MODE_TITLES.get(pdv, pdv) if pdv != "pdv" else "PDV"

    def tput(mode, c):
        return value(by_mode, mode, c, "output_tok_s")

    def p95(mode, c):
        return value(by_mode, mode, c, "e2e_p95_ms")

    checks = []

    def add(target, evaluated):
        misses = [d for good, d in evaluated if not good]
        status = "N/A" if not evaluated else ("MISS" if misses else "PASS")
        detail = (
            (f"missed at {'; '.join(misses)}" if misses else f"held at {len(evaluated)} concurrency level(s)")
            if evaluated
            else "no concurrency level with data for every mode involved"
        )
        checks.append({"target": target.replace("PDV", name), "status": status, "detail": detail})

    ev = []
    for c in (c for c in concurrency if c >= 8):
        v, d, b = tput(pdv, c), tput("pd", c), tput("baseline", c)
        if None not in (v, d):  # Baseline, run only at low concurrency, is checked where it ran
            ev.append(
                (
                    v >= d and (b is None or d >= b),
                    f"c={c} (PDV {v:.1f}, PD {d:.1f}, Baseline {'not run' if b is None else f'{b:.1f}'} tok/s)",
                )
            )
    add("PDV ≥ PD ≥ Baseline throughput at every concurrency ≥ 8", ev)
    ev = []
    for c in concurrency:
        v, d = p95(pdv, c), p95("pd", c)
        if None not in (v, d):
            ev.append((v <= d, f"c={c} (PDV {v:.0f} ms, PD {d:.0f} ms)"))
    add("PDV P95 latency ≤ PD P95 at every concurrency", ev)
    ev = []
    for c in concurrency:
        v, k = tput(pdv, c), tput("k0", c)
        if None not in (v, k):
            ev.append((v >= 0.97 * k, f"c={c} (PDV/k0 = {v / k:.3f})"))
    add("PDV throughput ≥ 0.97 × k0 at every concurrency", ev)
    ev = []
    v, k = tput(pdv, 1), tput("k0", 1)
    if None not in (v, k):
        ev.append((v >= 1.3 * k, f"c=1 (PDV/k0 = {v / k:.3f})"))
    add("PDV throughput ≥ 1.3 × k0 at concurrency 1", ev)
    return checks


def interpolate(points: dict[int, float], x: float) -> tuple[float | None, bool]:
    """(value at concurrency x, exact?) by linear interpolation between measured neighbours."""
    if x in points:
        return points[x], True
    lo = max((c for c in points if c < x), default=None)
    hi = min((c for c in points if c > x), default=None)
    if lo is None or hi is None:
        return None, False
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo), False


def theirs_section(by_mode, modes) -> list[str]:
    t = THEIRS
    out = [
        f"**The study's own figures — THEIRS: {t['source']}; not measured here, not comparable one-to-one "
        f"(different GPU, real weights and acceptance, their code)**",
        "",
        "| | theirs: peak tok/s (at c) | ours: peak tok/s (at c) |",
        "|---|---|---|",
    ]
    for m in ("baseline", "pd", "pdv", "pdv-split"):
        if m == "pdv-split" and m not in by_mode:
            continue
        theirs = t["peak_throughput"].get(m)
        pts = measured(by_mode, m, "output_tok_s")
        ours = max(pts.items(), key=lambda kv: kv[1]) if pts else None
        out.append(
            f"| {MODE_TITLES[m]} | {'–' if not theirs else f'{theirs[0]} (c={theirs[1]})'} | "
            f"{'–' if not ours else f'{ours[1]:,.1f} (c={ours[0]})'} |"
        )
    cs = t["p95_concurrency"]
    out += [
        "",
        "| P95 latency, ms | "
        + " | ".join(f"theirs c={c}" for c in cs)
        + " | "
        + " | ".join(f"ours c={c}" for c in cs)
        + " |",
        "|---|" + "---|" * (2 * len(cs)),
    ]
    approx = False
    for m in ("baseline", "pd", "pdv", "pdv-split"):
        if m not in t["p95_ms"] and m not in by_mode:
            continue
        pts = measured(by_mode, m, "e2e_p95_ms")
        ours = []
        for c in cs:
            v, exact = interpolate(pts, c)
            approx |= v is not None and not exact
            ours.append("–" if v is None else (f"{v:,.0f}" if exact else f"≈{v:,.0f}"))
        theirs = t["p95_ms"].get(m, ("–",) * len(cs))
        out.append(
            f"| {MODE_TITLES[m]} | " + " | ".join(fmt_theirs(v) for v in theirs) + " | " + " | ".join(ours) + " |"
        )
    if approx:
        out += [
            "",
            "≈: our sweep did not run that concurrency; linear interpolation between the two measured "
            "concurrencies around it.",
        ]
    out.append("")
    return out


def fmt_theirs(v) -> str:
    return f"{v:,}" if isinstance(v, (int, float)) else str(v)
