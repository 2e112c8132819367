"""Names and lookups that the seed-comparison sweep (bench/seed_study/seed_comparison.py) and its report share:
the load model, mode titles, file-name slugs, and rows by (mode, concurrency) with their values and ratios."""

from __future__ import annotations

import re

LOAD_MODEL = (
    "closed loop: N clients, each sending its next request as soon as the previous one ends "
    "(zero think time), so N requests are in flight"
)
MODE_TITLES = {
    "k0": "k0 (no speculation)",
    "baseline": "Baseline",
    "pd": "PD",
    "pdv": "PDV",
    "pdv-split": "PDV split (lane processes under MPS)",
    "pd-split": "PD split (lane processes under MPS)",
}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_").lower() or "x"


def table_by(rows: list[dict], pair: str) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["pair"] == pair:
            out.setdefault(r["mode"], {})[r["concurrency"]] = r
    return out


def ok(row: dict | None, key: str):
    if not row or row.get("status") != "ok":
        return None
    return row.get(key)


def value(by_mode: dict[str, dict[int, dict]], mode: str, c: int, key: str):
    """`key` of the (mode, concurrency) point where it ran; None where it is missing or failed."""
    return ok(by_mode.get(mode, {}).get(c), key)


def measured(by_mode: dict[str, dict[int, dict]], mode: str, key: str) -> dict[int, float]:
    """`key` at every concurrency where `mode` ran: {concurrency: value}."""
    return {c: r[key] for c, r in by_mode.get(mode, {}).items() if r.get("status") == "ok"}


def concurrencies(by_mode: dict[str, dict[int, dict]]) -> list[int]:
    """Every concurrency that any mode has a row for, ascending."""
    return sorted({c for m in by_mode.values() for c in m})


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def mode_order(modes) -> list[str]:
    known = ["k0", "baseline", "pd", "pd-split", "pdv", "pdv-split"]
    return [m for m in known if m in modes] + sorted(m for m in modes if m not in known)
