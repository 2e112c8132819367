"""The core loop (CoreLoop): the one thread that touches the Router (which is not thread-safe).

It runs in the engine-core process (core/core_server.py; a thread of the gateway's process in tests) and
loops `router.step()` while there is work. Between steps it runs commands posted to its inbox by
the channel's reader thread (add a request, abort one, swap the runtime config, fail everything),
so an abort or config change takes effect before the next step. Each step's outputs, for all
requests at once, go to the `sink` in one call (one channel message per step).

Lane failures (split topology). A `LaneError` from a step (a lane process died, timed out or
refused a stale handle) does not fail the requests: the loop enters *recovery*. Chunks the step
committed before the failing call are delivered first (the router attaches them to the error), so
a client's stream never skips a token. While recovering, the loop keeps taking commands (new
requests queue, cancels work) and calls `recover()` every `RECOVER_POLL_S` until the lanes serve
again and are re-wired; then `router.reset_kv()` re-queues every request for recompute under the
new pools (prompt + tokens already streamed are re-prefilled, nothing is emitted twice). The
engine fails for good (every in-flight request UNAVAILABLE, health NOT_SERVING) only when the
lanes do not come back within `recovery_timeout_s`, when steps keep failing right after each
recovery (`max_consecutive_failures`), or when the supervisor reports a crash loop (`fail`).

Drain is the gateway's (gateway/server.py): it refuses new requests, waits for those in flight,
then tells the core to stop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import RequestSpec
from verifypd.router.router import Router

log = logging.getLogger("verifypd.router")


class Overloaded(Exception):
    """The waiting queue is full (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(Exception):
    """The engine core has failed (gRPC UNAVAILABLE)."""


class Draining(Unavailable):
    """The server is shutting down: retry on another replica (gRPC UNAVAILABLE)."""


RECOVER_POLL_S = 0.25


class StepSink(Protocol):
    """Where the loop thread puts results (core_server.CoreServer: the channel). Must not block long."""

    def step(self, outputs: list) -> None: ...  # RequestOutputs of one router step, all requests
    def fail(self, request_ids: list[str], code: str, message: str, fatal: bool) -> None: ...


class CoreLoop:
    def __init__(
        self,
        router: Router,
        sink: StepSink,
        *,
        max_queue: int = 256,
        on_failure: Callable[[str], None] | None = None,
        idle_wait_s: float = 0.2,
        recover: Callable[[], None] | None = None,
        recovery_timeout_s: float = 120.0,
        max_consecutive_failures: int = 3,
    ):
        self.router, self.sink = router, sink
        self.max_queue = max_queue
        self.failed: str | None = None
        self.recovering: str | None = None  # the lane failure being recovered from
        self.recoveries = 0  # completed recoveries
        self._recover = recover  # raises LaneError until the lanes serve and are wired
        self._recovery_timeout_s = recovery_timeout_s
        self._recover_since = 0.0
        self._max_consecutive = max_consecutive_failures
        self._consecutive = 0  # step failures with no successful step in between
        self._steps_at_recovery = -1
        self.step_started: float | None = None  # monotonic start of the step running now (None: between steps)
        self.steps = 0  # router steps completed
        self.step_seconds = 0.0  # wall time inside router.step (busy share)
        self.tokens_out = 0  # tokens delivered
        self.config_log: list[tuple[int, int]] = []  # (steps completed when applied, revision)
        self._on_failure = on_failure
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # request ids added and not finished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="verifypd-core-loop", daemon=True)
        # The GPU the models were loaded on (resolve_device made it current on the building thread):
        # Triton launches and CUDA graphs follow the running thread's current device, not the tensors'.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    # -- called from any thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def post(self, fn: Callable[[Router], object]) -> Future:
        """Runs fn(router) on the loop thread before its next step."""
        future: Future = Future()
        self._inbox.put((fn, future))
        return future

    def call(self, fn: Callable[[Router], object], timeout_s: float = 60.0):
        return self.post(fn).result(timeout_s)

    def submit(self, spec: RequestSpec) -> Future:
        """Adds a request (spec.request_id set by the caller) before the next step; the Future
        raises InvalidRequest, Overloaded or Unavailable."""

        def add(router: Router) -> str:
            if self.failed:
                raise Unavailable(self.failed)
            if router.scheduler.num_waiting >= self.max_queue:
                raise Overloaded(f"server queue is full ({router.scheduler.num_waiting} requests waiting); retry later")
            request_id = router.add_request(spec)
            self._live.add(request_id)
            return request_id

        return self.post(add)

    def cancel(self, request_id: str) -> None:
        """Client cancel / deadline: frees the request's blocks before the next step. No-op if done."""

        def abort(router: Router) -> None:
            if request_id in self._live:
                self._live.discard(request_id)
                router.abort(request_id)

        self.post(abort)

    def fail(self, message: str, code: str = "UNAVAILABLE") -> None:
        self.post(lambda router: self._fail_all(message, code))

    def lane_lost(self, message: str) -> None:
        """A lane stopped serving while idle (watchdog): recover before the next step."""
        self.post(lambda router: self._lane_lost(message))

    def in_flight(self) -> int:
        return len(self._live)

    # -- loop thread ---------------------------------------------------------------------
    def run(self) -> None:
        """The loop (on the loop thread, or the engine-core process's main thread) until stop()."""
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while not self._stop.is_set():
            busy = self.failed is None and self.recovering is None and self.router.has_work()
            wait = RECOVER_POLL_S if self.recovering is not None else self._idle_wait_s
            try:
                cmd = self._inbox.get(block=not busy, timeout=None if busy else wait)
            except queue.Empty:
                cmd = None
                if not busy:  # idle: gauges must show the idle state, not the last busy step
                    self.router.refresh_gauges()
            while cmd is not None:
                self._execute(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.failed is not None or self._stop.is_set():
                continue
            if self.recovering is not None:
                self._try_recover()
            elif self.router.has_work():
                self._step()
        close = getattr(self.router, "close", None)  # the router's pipelining worker thread, if any
        if close is not None:
            close()

    def _execute(self, cmd) -> None:
        if cmd is None:
            return
        fn, future = cmd
        try:
            future.set_result(fn(self.router))
        except BaseException as exc:  # handed to the caller, never kills the loop
            future.set_exception(exc)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.step_started = time.monotonic()
        try:
            outputs = self.router.step()
        except LaneError as exc:
            self._deliver(getattr(exc, "outputs", []))
            self._consecutive = self._consecutive + 1 if self.steps == self._steps_at_recovery else 1
            self._lane_lost(str(exc))
            return
        except Exception as exc:  # a bug; the router's state can no longer be trusted
            log.exception("engine step failed")
            self._fail_all(f"internal error in the engine: {exc}", "INTERNAL")
            return
        finally:
            self.step_started = None
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        self.tokens_out += sum(len(o.token_ids) for o in outputs)
        self._deliver(outputs)

    def _lane_lost(self, message: str) -> None:
        if self.failed is not None or self.recovering is not None:
            return
        if self._recover is None:
            log.error("lane failure: %s", message)
            self._fail_all(message, "UNAVAILABLE")
        elif self._consecutive > self._max_consecutive:
            log.error(
                "lane failure: %s; steps failed right after %d recoveries in a row: giving up",
                message,
                self._consecutive - 1,
            )
            self._fail_all(f"lanes keep failing after recovery: {message}", "UNAVAILABLE")
        else:
            log.warning(
                "lane failure: %s; recovering: %d requests wait and will be re-prefilled", message, len(self._live)
            )
            self.recovering = message
            self._recover_since = time.monotonic()

    def _try_recover(self) -> None:
        try:
            if self._recover is None:  # recovery starts only with a recover function (_lane_lost)
                raise RuntimeError("recovering lanes without a recover function")
            self._recover()
            requeued = self.router.reset_kv()
        except LaneError as exc:
            waited = time.monotonic() - self._recover_since
            if waited > self._recovery_timeout_s:
                log.error("lanes did not come back within %.0f s: %s", self._recovery_timeout_s, exc)
                self._fail_all(f"lanes did not come back within {self._recovery_timeout_s:.0f} s: {exc}", "UNAVAILABLE")
            return
        except Exception as exc:
            log.exception("recovery failed")
            self._fail_all(f"internal error while recovering the lanes: {exc}", "INTERNAL")
            return
        log.info(
            "lanes recovered after %.1f s: %d requests re-queued for recompute",
            time.monotonic() - self._recover_since,
            requeued,
        )
        self.recovering = None
        self.recoveries += 1
        self._steps_at_recovery = self.steps

    def _deliver(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            self.sink.step(outputs)

    def _fail_all(self, message: str, code: str) -> None:
        if self.failed is None:
            self.failed = message
            if self._on_failure:
                self._on_failure(message)
        ids, self._live = list(self._live), set()
        self.sink.fail(ids, code, message, True)
        for seq in self.router.sequences():  # no lane calls: just returns their blocks
            self.router.abort(seq.request_id)
