"""Small pieces of the router's lane calls (split out of router.py to keep it under 500 lines). Torch-free."""
from __future__ import annotations

from typing import Callable

from verifypd.lanes.interface import PoolInfo


class StartedPrefill:
    """A prefill call started beside a verify call; `result()` is (outputs, launch + wait seconds),
    as a pipelined prefill's Future gives."""

    def __init__(self, started, launch_s: float, clock: Callable[[], float]):
        self._started, self._launch_s, self._clock = started, launch_s, clock

    def result(self) -> tuple[list, float]:
        t0 = self._clock()
        results = self._started.result()
        return results, self._launch_s + self._clock() - t0


def pool_of(pools: tuple[PoolInfo, ...], role: str, required: bool = True) -> PoolInfo | None:
    """The pool of `role` a lane announced (None for a missing optional one)."""
    for pool in pools:
        if pool.role == role:
            return pool
    if not required:
        return None
    raise ValueError(f"lane announced no {role} pool")
