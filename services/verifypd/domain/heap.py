"""The Python heap of a long-running serving process.

A full (oldest-generation) garbage collection traverses every container object the process holds.
After importing torch, transformers and the tokenizer, a gateway or engine core holds about a
million of them, so each full collection paused the process for 50-150 ms (a CPU gateway under
load: two in 8 s, the longer 149 ms). Every stream stalls meanwhile, and anything that allocates
objects which outlive the young generations (trace spans, in-flight request state) makes full
collections come sooner. `freeze_startup_heap`, called once a process has finished starting, moves
everything alive then to the permanent generation, which collections no longer traverse: a full
collection then walks only what was allocated since (vLLM's engine does the same).

Frozen objects are still freed by reference counting; only cycles among them stay, and the start-up
heap (modules, models, graphs, tables) lives as long as the process anyway. A process that later
drops a whole engine (tests, benches) calls `thaw_heap` first.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects once, then freezes every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Undoes `freeze_startup_heap`: frozen objects are collectable again."""
    gc.unfreeze()
