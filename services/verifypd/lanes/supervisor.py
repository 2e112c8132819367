"""Supervision of the lane processes `verifypd serve --topology split` started.

A thread polls the children. A lane that exits (crash, OOM kill, SIGKILL) while the server is not
stopping is started again on the same port after a back-off that doubles with each restart in
the window (0.5 s, 1 s, 2 s, ... capped at `max_backoff_s`). More than `max_restarts` restarts
within `window_s` is a crash loop: one clear log line, no more restarts, and `on_give_up` (the
gateway then ends in-flight requests with UNAVAILABLE and turns NOT_SERVING).

The supervisor only restarts processes; the gateway notices the failure on its next lane call
(or its watchdog), waits for the lane to serve again, re-wires the pools and re-prefills the
requests in flight (core/loop.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("verifypd.supervisor")


class LaneSupervisor:
    def __init__(
        self,
        procs,
        on_give_up: Callable[[str], None],
        *,
        max_restarts: int = 5,
        window_s: float = 60.0,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        poll_s: float = 0.1,
    ):
        self.procs = procs
        self.on_give_up = on_give_up
        self.max_restarts, self.window_s = max_restarts, window_s
        self.base_backoff_s, self.max_backoff_s, self.poll_s = base_backoff_s, max_backoff_s, poll_s
        self.restarts: dict[str, deque[float]] = {}
        self.total_restarts = 0
        self.gave_up: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lane-supervisor", daemon=True)

    def start(self) -> LaneSupervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.procs.stopping or self.gave_up:
                return
            for lane, proc in list(self.procs.procs.items()):
                code = proc.poll()
                if code is not None and not self._stop.is_set() and not self.procs.stopping:
                    self._handle_exit(lane, proc.pid, code)

    def _handle_exit(self, lane: str, pid: int, code: int) -> None:
        now = time.monotonic()
        recent = self.restarts.setdefault(lane, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            self.gave_up = (
                f"{lane} lane crash loop: exited (code {code}) after {len(recent)} restarts within "
                f"{self.window_s:.0f} s; not restarting it again"
            )
            log.error("%s; the gateway stops serving", self.gave_up, extra={"lane": lane, "reason": "crash_loop"})
            self.on_give_up(self.gave_up)
            return
        backoff = min(self.max_backoff_s, self.base_backoff_s * (2 ** len(recent)))
        log.error(
            "%s lane (pid %d) exited with code %s; restarting it in %.1f s (restart %d in the last %.0f s)",
            lane,
            pid,
            code,
            backoff,
            len(recent) + 1,
            self.window_s,
            extra={"lane": lane, "reason": f"exit_code_{code}"},
        )
        if self._stop.wait(backoff) or self.procs.stopping:
            return
        recent.append(time.monotonic())
        try:
            new_pid = self.procs.restart(lane)
        except (RuntimeError, OSError) as exc:
            log.error("cannot restart the %s lane: %s", lane, exc, extra={"lane": lane, "reason": "restart_failed"})
            return
        self.total_restarts += 1
        log.info("%s lane restarted, pid %d", lane, new_pid, extra={"lane": lane, "reason": "restarted"})
