"""The k = 0 hold of the lock-step batch (KDecision.batch_k; docs/engine.md "The k = 0 hold").
Torch-free.

Once the batch is decided off (k 0) with no request a probe could take now, its plain steps skip the
policy's per-request checks (opening and periodic probe candidates, the probe's costing) and, while
the decision's inputs stand, the decision itself: a k = 0 step with a draft attached then costs the
host what a plain step costs. The hold ends when a request joins (it may be probed: an opening
probe), when a decision drafts or probes, and, for a draft that can always be probed (pool-less:
prompt lookup has no KV to catch up), when a periodic probe may run (due, and its cost covered by
the probe budget, ProbeSchedule), so the hold delays no probe.
"""

from __future__ import annotations

from verifypd.router.draft_length import ProbeSchedule


class ZeroHold:
    def __init__(self) -> None:
        # Requests joined the running set `roster` times (queued, admitted); the hold is the roster
        # it began at (-1: none). A request leaving keeps it: the others still cannot be probed.
        self.roster = 0
        self._at = -1
        # A probe's cost (plain steps above a plain step) that ends the hold once due and covered;
        # None: no request can take a probe until one joins (their draft KV lags: it only grows).
        self._probe_extra: float | None = None
        self.steps = 0  # held decisions (benchmarks, tests: Scheduler.held_steps)

    def joined(self) -> None:
        self.roster += 1

    def begin(self, probe_extra: float | None = None) -> None:
        self._at, self._probe_extra = self.roster, probe_extra

    def end(self) -> None:
        self._at = -1

    def active(self, probes: ProbeSchedule) -> bool:
        """In the hold: no request joined since it began, and no probe it waits for may run now."""
        if self._at != self.roster:
            return False
        extra = self._probe_extra
        return extra is None or probes.steps_off < probes.interval or probes.credit < extra
