"""The gateway in `colocated` topology, over real gRPC on localhost: output equal to the offline
engine, validation, cancellation, overload, Control, health, reflection, telemetry, the CLI client."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from services_helpers import (
    Client,
    SlowLane,
    engine_options,
    free_port,
    greedy_request,
    offline_outputs,
    random_prompts,
    wait_until,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import control_pb2, generate_pb2

ADMIN_KEY = "test-admin-key-0123456789"  # Control.UpdateConfig needs it (auth.gateway_access)


class Recorder:
    """Observer in front of the gateway's telemetry: k of every verify item, per router step."""

    def __init__(self, inner):
        self.inner, self.steps, self.k_by_step = inner, 0, {}

    def on_verify(self, k, accepted):
        self.k_by_step.setdefault(self.steps, []).append(k)
        self.inner.on_verify(k, accepted)

    def on_step(self, router):
        self.steps += 1
        self.inner.on_step(router)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def start_gateway(tiny_models, *, readers=None, max_queue=256, **option_overrides):
    from verifypd.core.telemetry import Telemetry
    from verifypd.gateway.server import build_colocated

    telemetry = Telemetry(readers=readers)
    gw = build_colocated(
        engine_options(*tiny_models, **option_overrides), observer=telemetry, max_queue=max_queue, admin_key=ADMIN_KEY
    )
    router = gw.router
    router.verify_lane = SlowLane(router.verify_lane)  # before start: the engine thread owns it after
    router.observer = Recorder(router.observer)
    return gw.start()


@pytest.fixture(scope="module")
def metrics_reader():
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    return InMemoryMetricReader()


@pytest.fixture(scope="module")
def gateway(tiny_models, metrics_reader):
    gw = start_gateway(tiny_models, readers=[metrics_reader])
    yield gw
    gw.stop()


@pytest.fixture()
def client(gateway):
    gateway.router.verify_lane.delay_s = 0.0
    c = Client(gateway.address)
    yield c
    c.close()


def blocks_in_use(gw) -> tuple[int, int]:
    return gw.core_loop.call(lambda r: (r.target_blocks.num_used, r.draft_blocks.num_used))


@pytest.mark.slow
def test_greedy_output_equals_offline_engine(tiny_models, client):
    prompts = random_prompts(8, seed=0)
    expected = offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False) for p in prompts]
    )
    results: dict[int, list[int]] = {}

    def run(n):  # concurrent: requests join and leave the batch as the router likes
        results[n] = client.generate(**greedy_request(prompts[n]))[0]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(n) for n in range(len(prompts))] == expected


def test_text_prompt_and_response_fields(client):
    ids, msgs = client.generate(text="w5 w6 w7", max_tokens=10, stop_at_eos=False, request_id="mine")
    last = msgs[-1]
    assert all(m.request_id == "mine" for m in msgs)
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert all(m.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert len(ids) == 10 and last.usage.completion_tokens == 10 and last.usage.prompt_tokens == 3
    assert last.usage.draft_tokens > 0 and 0 <= last.usage.accepted_tokens <= last.usage.draft_tokens
    assert "".join(m.text for m in msgs).split() == [f"w{t}" for t in ids]
    same, _ = client.generate(token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]), max_tokens=10, stop_at_eos=False)
    assert same == ids


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampling_with_seed_equals_offline_engine(tiny_models, client, top_k):
    prompt = [5, 9, 13, 40]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=top_k, seed=1234)
    expected = offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(prompt), max_tokens=20, stop_at_eos=False, sampling=sampling)]
    )
    ids, _ = client.generate(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        max_tokens=20,
        stop_at_eos=False,
        sampling=generate_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=top_k, seed=1234),
    )
    assert [ids] == expected


BAD = [
    ("no prompt", dict(), "prompt"),
    ("empty text", dict(text=""), "text"),
    ("empty ids", dict(token_ids=generate_pb2.TokenIds(ids=[])), "token_ids"),
    ("id out of vocab", dict(token_ids=generate_pb2.TokenIds(ids=[3, 5000])), "token ids"),
    (
        "negative temperature",
        dict(text="w5", sampling=generate_pb2.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    ("top_p above 1", dict(text="w5", sampling=generate_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    ("negative top_k", dict(text="w5", sampling=generate_pb2.SamplingParams(top_k=-2)), "sampling.top_k"),
    ("k too large", dict(text="w5", speculation=generate_pb2.SpeculationOverride(max_k=99)), "speculation.max_k"),
    ("priority", dict(text="w5", priority=1000), "priority"),
    ("empty stop", dict(text="w5", stop=["x", ""]), "stop[1]"),
    (
        "no chat template",
        dict(chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="hi")])),
        "chat template",
    ),
    ("prompt longer than context", dict(token_ids=generate_pb2.TokenIds(ids=[5] * 300)), "context"),
]


@pytest.mark.parametrize("fields,names", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_requests_name_the_field(client, fields, names):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names in err.value.details()


def test_a_request_id_is_each_callers_own_label(client, gateway):
    """Two callers send the same request_id at once: both are served in full, each sees its id
    echoed, and the one that cancels ends only its own request (ids never key requests across
    callers: the gateway's own ids do)."""
    gateway.router.verify_lane.delay_s = 0.05
    other = Client(gateway.address)
    try:
        first = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5, 6], 40), request_id="dup"))
        assert next(first).request_id == "dup"  # in flight now
        ids, msgs = other.generate(**greedy_request([5, 6], 5), request_id="dup")
        assert len(ids) == 5 and all(m.request_id == "dup" for m in msgs)
        rest = list(first)
        assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert rest[-1].usage.completion_tokens == 40

        # Cancel one of two same-id requests: the other runs to its end.
        victim = other.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([7, 8], 30), request_id="same"))
        keeper = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([7, 8], 30), request_id="same"))
        next(victim), next(keeper)
        victim.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(victim)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        kept = list(keeper)
        assert kept[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert kept[-1].usage.completion_tokens == 30
    finally:
        other.close()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_and_deadline_free_blocks(client, gateway, how):
    # 200 tokens take >= 40 steps (k = 4); >= 6 s at 0.15 s a step, past the 3 s deadline, by when
    # at most 20 steps (100 tokens) ran: finishing would take >= 20 more steps.
    gateway.router.verify_lane.delay_s = 0.15
    call = client.gen.Generate(
        generate_pb2.GenerateRequest(**greedy_request(list(range(3, 30)), 200)),
        timeout=None if how == "cancel" else 3,
    )
    next(call)
    assert blocks_in_use(gateway) != (0, 0)
    if how == "cancel":
        call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == (grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED)
    gateway.router.verify_lane.delay_s, steps = 0.5, gateway.core_loop.steps
    # The abort runs on the engine thread before its next step: a couple of (slow) steps, not the
    # >= 20 more that finishing the request would take (counted in steps, not seconds).
    assert wait_until(lambda: blocks_in_use(gateway) == (0, 0), timeout_s=60)
    assert gateway.core_loop.steps - steps < 10, "the request ran on: not aborted"


def test_update_config_takes_effect_on_next_step(client, gateway):
    admin = Client(gateway.address, bearer=ADMIN_KEY)
    recorder = gateway.router.observer
    before = client.control.GetConfig(control_pb2.GetConfigRequest())
    assert (before.k_initial, before.adaptive) == (4, False)
    gateway.router.verify_lane.delay_s = 0.02
    start = recorder.steps  # the gateway is idle: steps from here on are this request's
    call = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([7, 8, 9], 120)))
    msgs = [next(call), next(call), next(call)]
    applied = admin.control.UpdateConfig(
        control_pb2.UpdateConfigRequest(
            config=control_pb2.RuntimeConfig(k_initial=1, priorities=control_pb2.LanePriorities(prefill=5)),
            requested_by="test",
            reason="k to 1",
        )
    )
    assert (applied.k_initial, applied.k_max, applied.priorities.prefill, applied.priorities.draft) == (1, 8, 5, 2)
    assert applied.revision == before.revision + 1
    msgs += list(call)
    steps_at_swap, revision = gateway.core_loop.config_log[-1]
    assert revision == applied.revision
    ks = {s: v for s, v in recorder.k_by_step.items() if s >= start}
    assert steps_at_swap > start and all(v == [4] for s, v in ks.items() if s < steps_at_swap)
    first_after = min(s for s in ks if s >= steps_at_swap)
    assert first_after == steps_at_swap and ks[first_after] == [1], "the step right after the swap uses k=1"
    assert {m.applied_k for m in msgs[-10:-2]} == {1} and msgs[0].applied_k == 0  # first: prefill
    assert client.control.GetConfig(control_pb2.GetConfigRequest()).k_initial == 1
    # Invalid: nothing changes.
    with pytest.raises(grpc.RpcError) as err:
        admin.control.UpdateConfig(control_pb2.UpdateConfigRequest(config=control_pb2.RuntimeConfig(k_min=9)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "k_min" in err.value.details()
    after = client.control.GetConfig(control_pb2.GetConfigRequest())
    assert (after.k_min, after.revision) == (0, applied.revision)
    admin.control.UpdateConfig(
        control_pb2.UpdateConfigRequest(
            config=control_pb2.RuntimeConfig(k_initial=4, priorities=control_pb2.LanePriorities(prefill=0))
        )
    )
    admin.close()


def test_overload_gives_resource_exhausted(tiny_models):
    gw = start_gateway(tiny_models, max_queue=1, max_running=1)
    gw.router.verify_lane.delay_s = 0.05
    client = Client(gw.address)
    try:
        calls = [client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5 + n], 30))) for n in range(4)]
        codes = []
        for call in calls:
            try:
                list(call)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "queue is full" in exc.details()
        # Four arrivals against one running slot and a one-request queue: at least one is refused;
        # one or two are admitted (the second only if the first left the queue before it arrived:
        # the asyncio gateway usually hands all four to the core before its next step).
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1 and codes.count(grpc.StatusCode.OK) >= 1
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        ids, _ = client.generate(**greedy_request([5], 4))  # the queue drained: served again
        assert len(ids) == 4
    finally:
        client.close()
        gw.stop()


def test_health_reflection_and_server_info(client):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert client.health_status() == health_pb2.HealthCheckResponse.SERVING
    assert client.health_status("verifypd.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"verifypd.v1.Generation", "verifypd.v1.Control", "grpc.health.v1.Health"} <= names
    info = client.gen.GetServerInfo(generate_pb2.ServerInfoRequest())
    assert info.topology == "colocated" and info.max_context == 256 and info.version


def test_telemetry_metric_names(client, metrics_reader):
    from verifypd.domain import metric_names as mn

    client.generate(**greedy_request([5, 6, 7], 12))
    data = metrics_reader.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {
        mn.TIME_TO_FIRST_TOKEN,
        mn.TIME_PER_OUTPUT_TOKEN,
        mn.REQUEST_DURATION,
        mn.TOKEN_USAGE,
        mn.LANE_STEP_DURATION,
        mn.LANE_QUEUE_DEPTH,
        mn.DRAFT_TOKENS,
        mn.ACCEPTED_TOKENS,
        mn.APPLIED_K,
        mn.KV_BLOCKS_IN_USE,
        mn.ACCEPTANCE_RATE,
    } <= names


def test_cli_generate_against_server(gateway, capsys):
    from verifypd.cli import main

    assert main(["generate", "--server", gateway.address, "--raw", "--json", "--max-tokens", "8", "w5 w6 w7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "request_id",
        "text",
        "token_ids",
        "finish_reason",
        "usage",
        "ttft_s",
        "target",
        "draft",
        "device",
    }
    assert len(out["token_ids"]) <= 8 and out["usage"]["prompt_tokens"] == 3
    # Without --raw the CLI asks for the chat template and falls back to text like the offline CLI.
    assert main(["generate", "--server", gateway.address, "--max-tokens", "8", "w5 w6 w7"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == out["text"].strip() and "tokens" in captured.err and "tok/s" in captured.err


@pytest.mark.slow
def test_cli_unreachable_server_exits_2(capsys):
    from verifypd.cli import main

    assert main(["generate", "--server", f"127.0.0.1:{free_port()}", "hello"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and len(err.strip().splitlines()) == 1
