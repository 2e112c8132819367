"""Tracing's cost read from one loadgen run whose requests are traced in alternate time slots
(`verifypd-loadgen --trace-alternate S --raw-records`): each traced slot is compared with the
untraced slot beside it, so the server's slow drifts (segments of one untraced server read ±25 %
apart under the same load) cancel within a pair instead of deciding it.

Slots: the raw records in start order switch arm (a `traceparent` or none) exactly at slot edges,
since every client process decides by the same monotonic clock; a slot runs from its first request's
start to the next slot's. Its rate: output tokens delivered (each message's tokens at its arrival,
rebuilt from ttft and the inter-message gaps) from `guard_s` after its start to its end, per second;
the guard skips the tail of the other arm's requests still streaming. The first and last slots
(partial) are dropped; pairs are consecutive slots (one of each arm), their ratio traced / untraced.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence


def slots(records: Sequence[dict]) -> list[tuple[bool, float, float]]:
    """(traced, start s, end s) of each whole slot, in order."""
    ordered = sorted((r for r in records if r.get("start_ms") is not None), key=lambda r: r["start_ms"])
    edges: list[tuple[bool, float]] = []  # (arm, its first request's start)
    for r in ordered:
        arm = bool(r.get("traceparent"))
        if not edges or edges[-1][0] != arm:
            edges.append((arm, r["start_ms"] / 1e3))
    return [(arm, start, edges[i + 1][1]) for i, (arm, start) in enumerate(edges[:-1])][1:]


def token_times(records: Sequence[dict]) -> tuple[list[float], list[int]]:
    """Arrival times (s, sorted) of every token-bearing message, and its tokens."""
    events = []
    for r in records:
        if r.get("ttft_ms") is None or not r.get("chunk_tokens"):
            continue
        t = (r["start_ms"] + r["ttft_ms"]) / 1e3
        gaps = [0.0] + [g / 1e3 for g in r.get("itl_chunk_ms") or []]
        for gap, n in zip(gaps, r["chunk_tokens"], strict=False):
            t += gap
            events.append((t, n))
    events.sort()
    return [t for t, _ in events], [n for _, n in events]


def slot_rates(records: Sequence[dict], guard_s: float) -> list[tuple[bool, float]]:
    """(traced, output tokens per second after the guard) of each whole slot."""
    times, tokens = token_times(records)
    cumulative = [0]
    for n in tokens:
        cumulative.append(cumulative[-1] + n)
    rates = []
    for arm, start, end in slots(records):
        lo, hi = start + guard_s, end
        if hi - lo <= 0:
            continue
        count = cumulative[bisect.bisect_left(times, hi)] - cumulative[bisect.bisect_left(times, lo)]
        rates.append((arm, count / (hi - lo)))
    return rates


def paired_ratios(rates: Sequence[tuple[bool, float]]) -> list[float]:
    """Traced / untraced rate of each pair of consecutive slots (0-1, 2-3, ...)."""
    out = []
    for (arm_a, a), (arm_b, b) in zip(rates[0::2], rates[1::2], strict=False):
        if arm_a == arm_b:
            continue  # (a slot dropped by its guard broke the alternation)
        on, off = (a, b) if arm_a else (b, a)
        if off > 0:
            out.append(on / off)
    return out


def overhead(ratios: Sequence[float]) -> float | None:
    """1 - the median paired ratio."""
    return round(1 - statistics.median(ratios), 4) if ratios else None
