"""domain/logs.RateLimit: a flood of one log line becomes a few lines and a count of the rest."""

from __future__ import annotations

import logging

from verifypd.domain.logs import RateLimit


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def records(logger_name: str, n: int, msg: str = "accept failed: %s") -> list[logging.LogRecord]:
    return [
        logging.LogRecord(logger_name, logging.ERROR, __file__, 1, msg, ("Too many open files",), None)
        for _ in range(n)
    ]


def test_a_flood_is_cut_to_the_burst_and_the_rest_is_counted():
    clock = Clock()
    limit = RateLimit(burst=5, per_s=10.0, clock=clock)
    passed = [r for r in records("asyncio", 10_000) if limit.filter(r)]
    assert len(passed) == 5
    clock.t = 10.0  # next window: the first line says how many were dropped
    first, *rest = [r for r in records("asyncio", 3) if limit.filter(r)]
    assert "[suppressed 9995 similar lines in the last 10 s]" in first.getMessage()
    assert len(rest) == 2 and "suppressed" not in rest[0].getMessage()


def test_other_messages_and_loggers_have_their_own_budget():
    limit = RateLimit(burst=2, per_s=10.0, clock=Clock())
    assert sum(limit.filter(r) for r in records("asyncio", 5)) == 2
    assert sum(limit.filter(r) for r in records("asyncio", 5, msg="other %s")) == 2
    assert sum(limit.filter(r) for r in records("grpc._server", 5)) == 2
