"""Hostile HTTP bodies: every one gets a 4xx naming the problem, none a 5xx or a hang,
and nothing leaks (KV blocks and open request streams back to 0 afterwards).

The bodies are generated from a fixed seed: valid requests with one parameter replaced by a
hostile value (huge, negative, NaN, wrong type, deep nesting, giant lists), random bytes and
truncated JSON, and nesting far past the JSON depth limit.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from http_helpers import (
    MODEL,
    HttpGateway,
)
from services_helpers import wait_until

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
FUZZ_BODIES = 2500


@pytest.fixture(scope="module")
def server(chat_models):
    s = HttpGateway(chat_models)
    yield s
    s.stop()


def post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("opener,closer", [('{"a":', "}"), ("[", "]")])
@pytest.mark.parametrize("depth", [100, 2000, 200_000])
def test_deeply_nested_json_is_a_400_naming_the_limit(server, opener, closer, depth):
    body = (opener * depth + "1" + closer * depth).encode()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = post(client, COMP, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert "nest" in err["message"] and "depth" in err["message"] and "limit" in err["message"], err
    assert err["code"] == "json_too_deep" and "Traceback" not in r.text


@pytest.mark.parametrize(
    "path,body",
    [
        (COMP, b'{"model": "tiny", "prompt": "w5 \\ud800"}'),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff w5"}]}'),
        (COMP, b'{"model": "tiny", "prompt": "w5", "stop": ["\\uD800"]}'),
        (COMP, b'{"model": "tiny", "prompt": "w5", "\\ud800": 1}'),
    ],
)
def test_lone_surrogates_are_a_400(server, path, body):
    """Valid JSON, but text UTF-8 cannot carry (it failed in the protobuf conversion: a 500)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = post(client, path, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text", r.text[:300]
    # A valid surrogate pair (an emoji) is text like any other.
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = post(client, COMP, b'{"model": "tiny", "prompt": "w5 \\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text[:300]


# -- generated bodies --------------------------------------------------------------------------
PARAMS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "priority",
    "speculation",
    "ignore_eos",
    "messages",
    "prompt",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "metadata",
    "best_of",
    "echo",
    "no_such_param",
    "",
]


def hostile_values(rng: random.Random) -> list:
    nested = 1
    for _ in range(rng.choice([3, 31, 40])):
        nested = [nested] if rng.random() < 0.5 else {"a": nested}
    return [
        None,
        True,
        False,
        0,
        -1,
        1,
        2,
        2**31,
        -(2**31) - 1,
        2**63,
        2**64,
        10**30,
        -(10**30),
        1e308,
        -1e308,
        1e-45,
        float("nan"),
        float("inf"),
        float("-inf"),
        0.5,
        -0.5,
        "",
        "x",
        "w5",
        "\x00",
        "\ud800",
        "é" * 300,
        "w5 " * 5000,
        [],
        [1],
        [[]],
        [None],
        {},
        {"a": 1},
        {"max_k": 2**40},
        {"disable": "yes"},
        {"include_usage": 1},
        list(range(5000)),
        [2**40],
        [-1],
        ["w5"] * 100,
        [""],
        ["\ud800"],
        nested,
        [{"role": "user", "content": None}],
        [{"role": "robot", "content": "w5"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user"}],
        ["w5", "w6"],
    ]


def valid_body(rng: random.Random, path: str) -> dict:
    body = {
        "model": MODEL,
        "max_tokens": rng.randint(1, 3),
        "temperature": rng.choice([0, 0.7]),
        "seed": rng.randrange(2**64),
        "stream": rng.random() < 0.3,
    }
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "w5 w6"}]
    else:
        body["prompt"] = rng.choice(["w5 w6", [5, 6, 7]])
    return body


def hostile_body(rng: random.Random, path: str, values: list) -> bytes:
    kind = rng.random()
    if kind < 0.06:  # not JSON at all, or cut short
        whole = json.dumps(valid_body(rng, path)).encode()
        return rng.choice(
            [
                bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))),
                whole[: rng.randrange(len(whole))],
                b"\xff\xfe{}",
                b"",
                b"null",
                b"[]",
                b'"x"',
                b"1e999",
                b"{" * 3000,
            ]
        )
    if kind < 0.1:  # nested past the depth limit, inside an otherwise valid body
        body = valid_body(rng, path)
        deep = "1"
        for _ in range(rng.choice([33, 999, 5000])):
            deep = "[" + deep + "]"
        return json.dumps(body)[:-1].encode() + b', "metadata": ' + deep.encode() + b"}"
    body = valid_body(rng, path)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name = rng.choice(PARAMS)
        if rng.random() < 0.1:
            body.pop(name, None)
        else:
            body[name] = rng.choice(values)
    return json.dumps(body, allow_nan=True).encode()


def answer(client: httpx.Client, path: str, body: bytes) -> httpx.Response | str:
    try:
        return post(client, path, body)
    except httpx.HTTPError as exc:  # a dropped connection or a hang is a failure like a 5xx
        return f"{type(exc).__name__}: {exc}"


def check_answer(r: httpx.Response | str, body: bytes) -> None:
    assert not isinstance(r, str), f"{r} for body {body[:200]!r}"
    what = f"{r.status_code} for body {body[:200]!r}: {r.text[:300]}"
    assert r.status_code < 500, what
    assert "Traceback" not in r.text, what
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], what
    else:
        assert r.status_code == 200, what
        assert (
            r.text.rstrip().endswith("data: [DONE]")
            if r.headers["content-type"].startswith("text/event-stream")
            else r.json()["choices"]
        ), what


@pytest.mark.slow
def test_fuzzed_bodies_get_4xx_and_leak_nothing(server):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(23)
    values = hostile_values(rng)
    bodies = [
        (path, hostile_body(rng, path, values)) for path in (rng.choice([CHAT, COMP]) for _ in range(FUZZ_BODIES))
    ]
    # A hang is an answer's 30 s timeout (check_answer fails on it), not a bound on the whole run.
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda pb: (answer(client, *pb), pb[1]), bodies))
    statuses = {}
    for r, body in answers:
        check_answer(r, body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(200, 0) > FUZZ_BODIES // 20 and statuses.get(400, 0) > FUZZ_BODIES // 2, statuses
    # Nothing left behind: no KV blocks, no open request streams, and the server still answers.
    assert wait_until(lambda: server.blocks_in_use() == (0, 0), timeout_s=30), server.blocks_in_use()
    assert wait_until(lambda: server.gw.client.in_flight() == 0, timeout_s=30)
    r = httpx.post(server.url + COMP, json={"model": MODEL, "prompt": "w5", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
