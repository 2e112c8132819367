"""The value types of loadgen's flags: each parses one flag value or raises ValueError, and
`flag_type` turns that into an argparse error naming the value (exit 2)."""

from __future__ import annotations

import argparse
import math


def flag_type(fn, what: str):
    """Wraps a parser so a bad value becomes an argparse error naming the flag's value."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: {e}") from None

    parse.__name__ = what
    return parse


def positive(cast, allow_inf: bool = False):
    def parse(text: str):
        v = cast(text)
        if not v > 0 or (math.isinf(v) and not allow_inf):
            raise ValueError("must be > 0")
        return v

    return parse


def comma_list(cast):
    return lambda text: [cast(t) for t in text.split(",") if t.strip()]


def endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT")
    return text


def http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise ValueError("expected http://HOST:PORT/v1 or https://...")
    return text


def fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise ValueError("must be in (0, 1]")
    return v


def ratio(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 1:
        raise ValueError("must be in [0, 1]")
    return v


def proc_count(text: str) -> int | str:
    if text == "auto":
        return text
    n = int(text)
    if n < 1:
        raise ValueError("must be >= 1 or auto")
    return n


def vocab_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.replace(",", ":").partition(":")
    lo_i, hi_i = int(lo), int(hi)
    if not 0 <= lo_i < hi_i:
        raise ValueError("expected LO:HI with 0 <= LO < HI")
    return lo_i, hi_i
