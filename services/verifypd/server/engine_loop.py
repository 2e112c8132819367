"""The engine thread: the one thread that touches the Router (which is not thread-safe).

It loops `router.step()` while there is work. Between steps it runs commands posted to its inbox
by gRPC handler threads (add a request, abort one, swap the runtime config, fail everything), so
an abort or config change takes effect before the next step. Outputs go to per-request queues
that the Generate handlers stream from.

A `LaneError` from a step (a lane process died or timed out) ends every in-flight request with
UNAVAILABLE and marks the engine failed: later requests get UNAVAILABLE at once, and the gateway
turns its health NOT_SERVING. Recovery is a later issue.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import grpc

from verifypd.engine.router import Router
from verifypd.engine.types import FinishReason, RequestSpec
from verifypd.lanes.interface import LaneError

log = logging.getLogger("verifypd.engine")


class Overloaded(Exception):
    """The waiting queue is full (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(Exception):
    """The engine has failed (gRPC UNAVAILABLE)."""


@dataclass
class Chunk:
    """One streamed piece of a request, snapshotted on the engine thread."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    usage: dict
    applied_k: int
    ttft_s: float | None


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str


class RequestStream:
    def __init__(self, request_id: str, sink=None):
        self.request_id = request_id
        # Chunk | Failure. Anything with put() (called on the engine thread, must not block or
        # raise): the HTTP API passes one that wakes its asyncio loop.
        self.queue = sink if sink is not None else queue.SimpleQueue()


class EngineLoop:
    def __init__(self, router: Router, *, max_queue: int = 256,
                 on_failure: Callable[[str], None] | None = None, idle_wait_s: float = 0.2):
        self.router = router
        self.max_queue = max_queue
        self.failed: str | None = None
        self.steps = 0                                # router steps completed
        self.config_log: list[tuple[int, int]] = []   # (steps completed when applied, revision)
        self._on_failure = on_failure
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verifypd-engine", daemon=True)

    # -- called from any thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def post(self, fn: Callable[[Router], object]) -> Future:
        """Runs fn(router) on the engine thread before its next step."""
        future: Future = Future()
        self._inbox.put((fn, future))
        return future

    def call(self, fn: Callable[[Router], object], timeout_s: float = 60.0):
        return self.post(fn).result(timeout_s)

    def submit(self, spec: RequestSpec, sink=None, *, wait: bool = True):
        """Adds a request; raises InvalidRequest, Overloaded or Unavailable. `sink`: see RequestStream.
        wait=False returns the Future of the RequestStream instead (the HTTP API awaits it)."""
        def add(router: Router) -> RequestStream:
            if self.failed:
                raise Unavailable(self.failed)
            if router.scheduler.num_waiting >= self.max_queue:
                raise Overloaded(f"server queue is full ({router.scheduler.num_waiting} requests waiting); "
                                 f"retry later")
            stream = RequestStream(router.add_request(spec), sink)
            self._streams[stream.request_id] = stream
            return stream
        return self.call(add) if wait else self.post(add)

    def cancel(self, stream: RequestStream) -> None:
        """Client cancel / deadline: frees the request's blocks before the next step. No-op if done."""
        def abort(router: Router) -> None:
            # Identity check: the id may already belong to a new request with the same client id.
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                router.abort(stream.request_id)
        self.post(abort)

    def fail(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.post(lambda router: self._fail_all(message, code))

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.failed is None and self.router.has_work()
            try:
                cmd = self._inbox.get(block=not busy, timeout=None if busy else self._idle_wait_s)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._execute(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.failed is None and self.router.has_work() and not self._stop.is_set():
                self._step()

    def _execute(self, cmd) -> None:
        if cmd is None:
            return
        fn, future = cmd
        try:
            future.set_result(fn(self.router))
        except BaseException as exc:  # handed to the caller, never kills the loop
            future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.router.step()
        except LaneError as exc:
            log.error("lane failure: %s", exc)
            self._fail_all(str(exc), grpc.StatusCode.UNAVAILABLE)
            return
        except Exception as exc:  # a bug; the router's state can no longer be trusted
            log.exception("engine step failed")
            self._fail_all(f"internal error in the engine: {exc}", grpc.StatusCode.INTERNAL)
            return
        self.steps += 1
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put(Chunk(out.token_ids, out.text, out.finished, out.finish_reason, out.stats.usage(),
                                   out.applied_k, out.stats.ttft))
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, message: str, code: grpc.StatusCode) -> None:
        if self.failed is None:
            self.failed = message
            if self._on_failure:
                self._on_failure(message)
        for stream in self._streams.values():
            stream.queue.put(Failure(code, message))
        self._streams.clear()
        for seq in self.router.sequences():  # no lane calls: just returns their blocks
            self.router.abort(seq.request_id)
