"""bench/serving/interleaved_slots.py: slots rebuilt from a `--trace-alternate` run's raw records,
their token rates after the guard, and the traced / untraced ratio of each pair of slots."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "serving"))
import interleaved_slots as slots_module


def _records(rates: list[float], slot_s: float = 2.0, per_slot: int = 20) -> list[dict]:
    """Requests started evenly through alternating slots (odd slots traced), each streaming one token
    a message at its slot's rate share, all inside its slot."""
    records = []
    for i, rate in enumerate(rates):
        for j in range(per_slot):
            start = i * slot_s + j * slot_s / per_slot
            tokens = max(1, round(rate * slot_s / per_slot))  # this request's share of the slot
            gap_ms = 1.0
            records.append(
                {
                    "start_ms": start * 1e3,
                    "ttft_ms": 1.0,
                    "itl_chunk_ms": [gap_ms] * (tokens - 1),
                    "chunk_tokens": [1] * tokens,
                    "traceparent": "00-1-2-01" if i % 2 else None,
                }
            )
    return records


def test_slots_drop_the_partial_ends_and_pair_each_traced_slot_with_its_neighbour():
    records = _records([100, 90, 100, 80, 100, 95])  # slot 0 and 5 are dropped as partial
    found = slots_module.slots(records)
    assert [arm for arm, *_ in found] == [True, False, True, False]
    assert [round(s, 3) for _, s, _ in found] == [2.0, 4.0, 6.0, 8.0]
    rates = slots_module.slot_rates(records, guard_s=0.0)
    assert [arm for arm, _ in rates] == [True, False, True, False]
    assert [r for _, r in rates] == pytest.approx([90, 100, 80, 100], rel=0.06)
    ratios = slots_module.paired_ratios(rates)
    assert ratios == pytest.approx([0.9, 0.8], rel=0.08)
    assert slots_module.overhead(ratios) == pytest.approx(0.15, abs=0.05)


def test_the_guard_skips_tokens_at_each_slot_start():
    records = _records([100, 100, 100, 100])
    whole = dict(slots_module.slot_rates(records, guard_s=0.0))
    # Tokens delivered in the first second of each slot are left out and the rate is per the rest.
    guarded = slots_module.slot_rates(records, guard_s=1.0)
    assert [r for _, r in guarded] == pytest.approx(list(whole.values()), rel=0.15)
    assert slots_module.slot_rates(records, guard_s=5.0) == []  # a guard past the slot leaves nothing
