"""The OpenAI-compatible HTTP API of the gateway, driven with the official `openai` client and raw
httpx: same output as gRPC Generate, usage, seeds, stop strings, every invalid parameter a 400
naming it, 404/413/429/503, a disconnect frees the KV, /health, /v1/models, /metrics."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from http_helpers import (
    MODEL,
    HttpGateway,
)
from services_helpers import (
    Client,
    greedy_request,
    random_prompts,
    wait_until,
)

from verifypd.v1 import generate_pb2


@pytest.fixture(scope="module")
def server(chat_models):
    s = HttpGateway(chat_models)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    server.slow.delay_s = 0.0
    return server.openai()


def post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=body if isinstance(body, bytes) else json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
        **kwargs,
    )


def test_completions_equal_grpc_generate(server, client):
    grpc_client = Client(server.gw.address)
    try:
        for prompt in random_prompts(3, seed=5):
            ids, msgs = grpc_client.generate(**greedy_request(prompt, 12))
            text = "".join(m.text for m in msgs)
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
            assert done.choices[0].text == text and done.model_extra["verifypd"]["token_ids"] == ids
            assert done.choices[0].finish_reason == "length" and done.object == "text_completion"
            chunks = list(
                client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=12, stream=True, extra_body={"ignore_eos": True}
                )
            )
            assert "".join(c.choices[0].text for c in chunks) == text
            assert [t for c in chunks for t in c.model_extra["verifypd"]["token_ids"]] == ids
            assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        # A text prompt goes through the same tokenizer as gRPC's `text`.
        ids, msgs = grpc_client.generate(text="w5 w6 w7", max_tokens=8, stop_at_eos=False)
        done = client.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=8, extra_body={"ignore_eos": True})
        assert done.choices[0].text == "".join(m.text for m in msgs)
    finally:
        grpc_client.close()


def test_chat_stream_usage_and_speculation_fields(server, client):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6 w7"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, extra_body={"ignore_eos": True}
    )
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    u = whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (4, 10, 14)
    ext = u.model_extra["verifypd"]
    d = u.completion_tokens_details
    assert ext["draft_tokens"] > 0 and d.accepted_prediction_tokens == ext["accepted_tokens"]
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == ext["draft_tokens"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_seeded_sampling_is_reproducible_and_equals_grpc(server, client):
    prompt = [5, 9, 13, 40]
    kwargs = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"ignore_eos": True, "top_k": 5},
    )
    a = client.completions.create(**kwargs).model_extra["verifypd"]["token_ids"]
    b = client.completions.create(**kwargs).model_extra["verifypd"]["token_ids"]
    c = client.completions.create(**{**kwargs, "seed": 99}).model_extra["verifypd"]["token_ids"]
    grpc_client = Client(server.gw.address)
    try:
        ids, _ = grpc_client.generate(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            max_tokens=16,
            stop_at_eos=False,
            sampling=generate_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=5, seed=1234),
        )
    finally:
        grpc_client.close()
    assert a == b == ids and c != a


def test_the_smallest_float32_top_p_keeps_only_the_top_token(client):
    """top_p 1.4e-45 (the smallest float32 > 0, accepted) truncates to the most likely token: sampling at
    temperature 1 then gives the greedy output, whatever the seed."""
    kwargs = dict(model=MODEL, prompt=[5, 9, 13, 40], max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kwargs, temperature=0).model_extra["verifypd"]["token_ids"]
    for seed in (1, 2):
        tiny = client.completions.create(**kwargs, temperature=1.0, top_p=1.4e-45, seed=seed)
        assert tiny.model_extra["verifypd"]["token_ids"] == greedy


def test_stop_string_and_speculation_override(client):
    base = client.completions.create(model=MODEL, prompt="w5 w6 w7", max_tokens=12, extra_body={"ignore_eos": True})
    words = base.choices[0].text.split()
    stop = words[3]
    cut = client.completions.create(
        model=MODEL, prompt="w5 w6 w7", max_tokens=12, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text.split()
    assert cut.choices[0].text.split() == words[: words.index(stop)]
    off = client.completions.create(
        model=MODEL, prompt="w5 w6 w7", max_tokens=12, extra_body={"ignore_eos": True, "speculation": {"disable": True}}
    )
    assert off.choices[0].text == base.choices[0].text and off.usage.model_extra["verifypd"]["draft_tokens"] == 0


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "w5"}]
BAD = [  # (path, body change, param named in the 400)
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "w5 nosuchword"}]}, None),  # unknown word -> <unk>: valid
    (COMP, {"prompt": None}, "prompt"),
    (COMP, {"prompt": ""}, "prompt"),
    (COMP, {"prompt": [3, 5000]}, "prompt"),
    (COMP, {"prompt": ["w5", "w6"]}, "prompt"),
    (COMP, {"prompt": [5] * 300}, "prompt"),
    (COMP, {"model": None}, "model"),
    (COMP, {"n": 0}, "n"),
    (COMP, {"n": 10**6}, "n"),
    (COMP, {"n": 2, "best_of": 1}, "best_of"),
    (COMP, {"best_of": 3, "stream": True}, "best_of"),
    (COMP, {"max_tokens": 0}, "max_tokens"),
    (COMP, {"max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"max_completion_tokens": -1}, "max_completion_tokens"),
    (COMP, {"temperature": -1}, "temperature"),
    (COMP, {"temperature": "hot"}, "temperature"),
    (COMP, {"top_p": 0}, "top_p"),
    (COMP, {"top_p": 1.5}, "top_p"),
    (COMP, {"top_p": 5e-324}, "top_p"),  # float32 (the wire) holds 0 = "unset": it sampled as top_p 1
    (COMP, {"top_p": 1e-46}, "top_p"),
    (COMP, {"temperature": 1e39}, "temperature"),  # float32 inf
    (COMP, {"top_k": -2}, "top_k"),
    (COMP, {"seed": -1}, "seed"),
    (COMP, {"stop": ["x", ""]}, "stop[1]"),
    (COMP, {"stop": 5}, "stop"),
    (COMP, {"priority": 1000}, "priority"),
    (COMP, {"speculation": {"max_k": 99}}, "speculation.max_k"),
    (COMP, {"speculation": {"k": 2}}, "speculation"),
    (COMP, {"stream": "yes"}, "stream"),
    (COMP, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMP, {"logprobs": 21}, "logprobs"),
    (COMP, {"logprobs": True}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (COMP, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (COMP, {"logit_bias": {"5": 101}}, "logit_bias"),
    (COMP, {"logit_bias": {"w5": 1}}, "logit_bias"),
    (COMP, {"presence_penalty": -2.5}, "presence_penalty"),
    (COMP, {"repetition_penalty": 0}, "repetition_penalty"),
    (COMP, {"min_tokens": -1}, "min_tokens"),
    (COMP, {"stop_token_ids": [99999]}, "stop_token_ids"),
    (COMP, {"frequency_penalty": 3.0}, "frequency_penalty"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (COMP, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (COMP, {"no_such_param": 1}, "no_such_param"),
    (COMP, {"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(
    "path,change,param", BAD, ids=[f"{p[-11:]}-{next(iter(c))}-{n}" for n, (p, c, _) in enumerate(BAD)]
)
def test_invalid_parameters_get_400_naming_them(server, path, change, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": MSG} if path == CHAT else {"prompt": "w5"}), **change}
    r = post(server, path, body)
    if param is None:
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"] and "Traceback" not in r.text


def test_openai_client_sees_bad_request_and_not_found(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="w5", temperature=-3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="w5")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_bad_json_body_limit_and_routes(server):
    assert post(server, COMP, b"{not json").status_code == 400
    assert post(server, COMP, b"[1, 2]").json()["error"]["message"].startswith("the request body")
    big = json.dumps({"model": MODEL, "prompt": "w5 " * (2 * 1024 * 1024)}).encode()
    r = post(server, COMP, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(server.url + COMP, content=iter([big[: len(big) // 2], big[len(big) // 2 :]]), timeout=30)
    assert chunked.status_code == 413  # no content-length: counted while reading
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + COMP).status_code == 405 and "error" in httpx.get(server.url + COMP).json()


def test_models_and_health(server, chat_models):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    entry = models["data"][0]
    assert entry["max_model_len"] == 256 and entry["verifypd"]["draft_model"] == chat_models[1]
    assert entry["verifypd"]["target_model"] == chat_models[0]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "serving"


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_kv(server, stream):
    server.slow.delay_s = 0.05  # 220 tokens take >= 44 steps; <= 10 of them run in the 0.5 s read timeout
    body = {"model": MODEL, "prompt": list(range(3, 30)), "max_tokens": 220, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + COMP, json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert server.blocks_in_use() != (0, 0)
    else:  # the client gives up (its timeout closes the connection) while the server is generating
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + COMP, json=body, timeout=httpx.Timeout(30, read=0.5))
    server.slow.delay_s, steps = 0.5, server.gw.core_loop.steps
    # Aborted on the engine thread before its next step: a couple of (slow) steps, not the >= 34
    # more that finishing the request would take (counted in steps, not seconds).
    try:
        assert wait_until(lambda: server.blocks_in_use() == (0, 0), timeout_s=60)
        assert server.gw.core_loop.steps - steps < 10, "the request ran on: not aborted"
    finally:
        server.slow.delay_s = 0.0


def test_metrics_parse_as_prometheus_text(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_server_request_duration_seconds",
        "gen_ai_client_token_usage",
        "verifypd_lane_step_duration_seconds",
        "verifypd_kv_blocks_in_use",
        "verifypd_lane_queue_depth",
        "verifypd_speculation_applied_k",
    ):
        assert name in families, sorted(families)
    ttft = families["gen_ai_server_time_to_first_token_seconds"]
    assert ttft.type == "histogram" and any(s.name.endswith("_count") and s.value >= 1 for s in ttft.samples)
    assert any("draft_tokens" in name for name in families)


def test_queue_full_429_and_not_serving_503(chat_models):
    s = HttpGateway(chat_models, max_queue=1, max_running=1)
    s.slow.delay_s = 0.05
    codes: list[int] = []
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 20, "ignore_eos": True}

    def send(n):
        r = post(s, COMP, {**body, "prompt": [5 + n]})
        codes.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "queue_full" and "queue is full" in r.json()["error"]["message"]

    try:
        threads = [threading.Thread(target=send, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        # Room for one running and one waiting; each request takes >= 1 s, the four arrive at once:
        # one or two are taken (two unless the second comes before the engine admitted the first).
        assert set(codes) <= {200, 429} and 1 <= codes.count(200) <= 2 and len(codes) == 4, codes
        with pytest.raises(openai.RateLimitError):  # what the official client makes of it
            s.gw.core_loop.max_queue = 0
            s.openai().completions.create(model=MODEL, prompt="w5", max_tokens=2)
        s.gw.core_loop.max_queue = 1
        # A failure after the stream began arrives as an error event, which the client raises.
        stream = s.openai().completions.create(
            model=MODEL, prompt=[5, 6], max_tokens=100, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        s.gw.core_loop.fail("test: a lane is down")
        with pytest.raises(openai.APIError, match="a lane is down"):
            list(stream)
        assert wait_until(lambda: httpx.get(s.url + "/health").status_code == 503, timeout_s=30)
        r = post(s, COMP, body)
        assert r.status_code == 503 and "a lane is down" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_no_delayed_ack_stall_per_request(server):
    """TCP_NODELAY on accepted sockets: without it every response (header and body are separate
    writes) waits for a delayed ACK, >= 40 ms on Linux. http.client sends each request in one write."""
    import http.client
    import statistics
    import time

    conn = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=10)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        times.append(time.perf_counter() - t0)
    conn.close()
    assert statistics.median(times) < 0.03, times


def test_api_key_guards_the_v1_routes(chat_models):
    """With --api-key, /v1 needs `Authorization: Bearer KEY` (as gRPC Generate does); probes stay open."""
    s = HttpGateway(chat_models, api_key="k" * 20)
    try:
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "k" * 20}):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 401
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="k" * 20, max_retries=0, timeout=60)
        assert ok.completions.create(**body).usage.completion_tokens == 4
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    finally:
        s.stop()
