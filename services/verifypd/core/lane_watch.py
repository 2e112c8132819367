"""When is a lane lost? The split topology's watchdog policy, apart from its thread (core_server.py).

A health check that is refused or answers NOT_SERVING means the lane process is gone or restarting:
lost at once. A check that merely times out is *slow*: on a loaded host a live lane can take seconds
to answer, and recovering from it would re-prefill every request for nothing. A lane is *hung* only
when its checks have kept failing for `hung_after_s` (the server's `--lane-timeout`: as long as one
lane call may take): a SIGSTOPped, deadlocked or swapping-to-death process. A hung lane is lost, and
the supervisor (lanes/supervisor.py) kills it so that it is restarted: its process would otherwise
live on and never serve again.
"""

from __future__ import annotations

from verifypd.lanes.rpc.lane_connection import DOWN, SERVING

OK, LOST, WAIT, HUNG = "ok", "lost", "wait", "hung"


class LaneWatch:
    """Per lane, since when its health checks have failed (monotonic seconds)."""

    def __init__(self, hung_after_s: float):
        self.hung_after_s = hung_after_s
        self._failing_since: dict[str, float] = {}

    def observe(self, lane: str, verdict: str, started: float, now: float) -> str:
        """What to do after one check of `lane` that began at `started` and ended at `now` with
        `verdict` (lane_connection SERVING / SLOW / DOWN): OK, LOST (recover), WAIT (slow, not yet
        hung) or HUNG (kill the process and recover)."""
        if verdict == SERVING:
            self._failing_since.pop(lane, None)
            return OK
        since = self._failing_since.setdefault(lane, started)
        if verdict == DOWN:
            return LOST
        if now - since >= self.hung_after_s:
            del self._failing_since[lane]  # the next failures (a restart under way) start a new span
            return HUNG
        return WAIT
