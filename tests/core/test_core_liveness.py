"""Is the engine core taking requests, and is a lane lost? (core/lane_watch.py, core_server.py
heartbeat and watchdog, core/client.py `admitting`.)

* A lane whose health checks time out is slow, not lost, until that lasts --lane-timeout (then hung:
  killed and recovered); a refused check is lost at once.
* A step stuck past --stall-timeout turns health NOT_SERVING; a request sent meanwhile waits and
  completes, and health is SERVING again afterwards.
* A core that sends nothing for CORE_SILENCE_S (stopped) fails waiting requests with UNAVAILABLE; a
  core that beats while its loop is busy does not.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from services_helpers import Client, engine_options, greedy_request, wait_until

from verifypd.core import client as core_client
from verifypd.core import core_server
from verifypd.core.channel import BlockingChannel
from verifypd.core.lane_watch import HUNG, LOST, OK, WAIT, LaneWatch
from verifypd.lanes.rpc.lane_connection import DOWN, SERVING, SLOW


def test_lane_watch_tells_slow_from_hung_and_dead():
    watch = LaneWatch(hung_after_s=10.0)
    assert watch.observe("verify", SLOW, 0.0, 1.0) == WAIT
    assert watch.observe("verify", SLOW, 1.0, 9.9) == WAIT  # 9.9 s of failing checks: still slow
    assert watch.observe("verify", SERVING, 10.0, 10.1) == OK  # answered: the span starts over
    assert watch.observe("verify", SLOW, 11.0, 12.0) == WAIT
    assert watch.observe("verify", SLOW, 20.0, 21.0) == HUNG  # 10 s since the first failing check began
    assert watch.observe("verify", SLOW, 21.0, 22.0) == WAIT  # a new span (the lane is being restarted)
    assert watch.observe("draft", DOWN, 0.0, 0.001) == LOST  # refused: dead or restarting, at once


class FakeLane:
    """A lane client whose health checks are slow (time out) for `slow_s`, then answer."""

    def __init__(self, name: str, slow_s: float):
        self.lane, self.addr, self.until = name, f"fake-{name}", time.monotonic() + slow_s
        self.checks = 0

    def probe(self, timeout_s: float) -> str:
        self.checks += 1
        if time.monotonic() < self.until:
            time.sleep(min(timeout_s, 0.05))
            return SLOW
        return SERVING

    def healthy(self, timeout_s: float) -> bool:
        return self.probe(timeout_s) == SERVING

    def close(self) -> None:
        pass


class LossRecorder:
    def __init__(self):
        self.lost: list[str] = []

    def lane_lost(self, message: str) -> None:
        self.lost.append(message)


def watchdog(lanes, lane_timeout_s: float, hung: list):
    a, b = socket.socketpair()
    core = core_server.CoreServer(
        router=None,
        channel=BlockingChannel(a),
        info=None,
        lanes=lanes,
        watch_interval_s=0.01,
        lane_timeout_s=lane_timeout_s,
        on_hung=hung.append,
    )
    core.loop = LossRecorder()  # type: ignore[assignment]  # the watchdog's only use of the loop
    thread = threading.Thread(target=core._watch_lanes, daemon=True)  # the thread start() runs
    thread.start()
    return core, thread, (a, b)


def test_slow_health_checks_on_a_loaded_host_start_no_recovery():
    lanes = (FakeLane("prefill", 0), FakeLane("draft", 1.5), FakeLane("verify", 0))
    hung: list = []
    core, thread, socks = watchdog(lanes, lane_timeout_s=30.0, hung=hung)
    assert wait_until(lambda: lanes[1].checks > 3 and time.monotonic() > lanes[1].until + 0.3, 30)
    core._stopped.set()
    thread.join(5)
    assert core.loop.lost == [] and hung == [], "a lane whose checks were slow for 1.5 s counted as lost"
    for s in socks:
        s.close()


def test_a_lane_unresponsive_for_the_lane_timeout_is_killed_and_lost():
    lanes = (FakeLane("prefill", 0), FakeLane("draft", 0), FakeLane("verify", 3600))
    hung: list = []
    core, thread, socks = watchdog(lanes, lane_timeout_s=0.5, hung=hung)
    assert wait_until(lambda: hung, 30), "a lane that never answered was not reported hung"
    core._stopped.set()
    thread.join(5)
    assert hung[0] == "verify" and "verify lane at fake-verify is hung" in core.loop.lost[0]
    for s in socks:
        s.close()


@pytest.fixture
def gateway(tiny_models):
    from verifypd.gateway.server import build_colocated

    gw = build_colocated(engine_options(*tiny_models), stall_timeout_s=0.5).start()
    yield gw
    gw.stop()


def test_a_stuck_step_turns_health_not_serving_and_its_waiting_requests_complete(gateway):
    router, release, entered = gateway.router, threading.Event(), threading.Event()
    step = router.step

    def stuck_step():  # the first step of the next request blocks, as on a hung lane
        if not release.is_set():
            entered.set()
            release.wait(60)
        return step()

    router.step = stuck_step
    c = Client(gateway.address)
    assert c.health_status() == health_pb2.HealthCheckResponse.SERVING
    out: dict = {}

    def send(key, prompt):
        try:
            out[key] = c.generate(**greedy_request(prompt, max_tokens=4), timeout=60)[0]
        except grpc.RpcError as exc:
            out[key] = exc.code()

    first = threading.Thread(target=send, args=("first", [5, 6, 7]))
    first.start()
    assert entered.wait(30)
    assert wait_until(lambda: c.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 15), (
        "health stayed SERVING while a step was stuck"
    )
    late = threading.Thread(target=send, args=("late", [8, 9]))
    late.start()  # sent while the core takes no request
    time.sleep(1.0)
    release.set()
    first.join(60)
    late.join(60)
    assert len(out["first"]) == 4 and len(out["late"]) == 4, out
    assert wait_until(lambda: c.health_status() == health_pb2.HealthCheckResponse.SERVING, 15)
    c.close()


def test_a_busy_core_that_beats_keeps_requests_a_silent_one_fails_them(tiny_models, monkeypatch):
    from verifypd.gateway.server import build_colocated

    monkeypatch.setattr(core_client, "CORE_SILENCE_S", 1.5)
    gw = build_colocated(engine_options(*tiny_models)).start()
    try:
        release = threading.Event()
        gw.core_loop.post(lambda router: release.wait(30))  # the loop thread is busy; the heartbeat goes on
        c = Client(gw.address)
        threading.Timer(4.0, release.set).start()  # longer than CORE_SILENCE_S
        ids, _ = c.generate(**greedy_request([5, 6], max_tokens=4), timeout=60)
        assert len(ids) == 4, "a request waiting on a busy (but beating) core was lost"
        # Now silence the core (as a stopped process would be): no heartbeat, loop busy.
        monkeypatch.setattr(core_server, "HEARTBEAT_S", 3600.0)
        time.sleep(1.2)  # the heartbeat thread's pending wait ends, one more beat, then none
        release2 = threading.Event()
        gw.core_loop.post(lambda router: release2.wait(30))
        with pytest.raises(grpc.RpcError) as err:
            c.generate(**greedy_request([5, 6], max_tokens=4), timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "has not answered" in err.value.details()
        assert c.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        release2.set()
        c.close()
    finally:
        gw.stop()
