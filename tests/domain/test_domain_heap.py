"""A serving process freezes its start-up heap (domain/heap.py): full collections then skip it."""

from __future__ import annotations

import gc

from verifypd.domain.heap import freeze_startup_heap, thaw_heap


def test_freeze_moves_the_live_heap_out_of_collections_and_thaw_brings_it_back():
    thaw_heap()
    keep = [[i] for i in range(1000)]  # container objects alive at the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(keep) and gc.get_freeze_count() == frozen
        tracked = len(gc.get_objects(generation=2))
        assert all(not any(x is o for o in gc.get_objects(generation=2)) for x in keep[:3])
        assert tracked < frozen  # what a full collection walks now: far less than before
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    assert any(keep[0] is o for o in gc.get_objects(generation=2))
