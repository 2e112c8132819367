"""When to send: inter-arrival gaps for open-loop load.

Poisson arrivals have exponential gaps with mean 1/rate. Gamma arrivals (as in vLLM's
`bench serve`) have gamma gaps with shape = burstiness and scale = 1/(rate * burstiness): the
mean rate is unchanged, burstiness < 1 gives burstier traffic (coefficient of variation
1/sqrt(burstiness)) and > 1 smoother; burstiness 1 is Poisson. An infinite rate sends
everything at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np


def gaps(rate: float, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds, seeded."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng([seed, 0x0A11])
    if arrival == "poisson":

        def draw(n: int) -> np.ndarray[Any, np.dtype[np.float64]]:
            return rng.exponential(1.0 / rate, size=n)

    elif arrival == "gamma":
        if burstiness <= 0:
            raise ValueError("burstiness must be > 0")

        def draw(n: int) -> np.ndarray[Any, np.dtype[np.float64]]:
            return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)

    else:
        raise ValueError(f"unknown arrival process {arrival!r}")
    while True:
        yield from (float(g) for g in draw(1024))


def schedule(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of the first n requests; the first is at 0."""
    it = gaps(rate, arrival, burstiness, seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += next(it)
        offsets.append(t)
    return offsets
