"""Hostile HTTP bodies (issue 23): every one gets a 4xx naming the problem, none a 5xx or a hang,
and nothing leaks (KV blocks and open request streams back to 0 afterwards).

The bodies are generated from a fixed seed: valid requests with one parameter replaced by a
hostile value (huge, negative, NaN, wrong type, deep nesting, giant lists), random bytes and
truncated JSON, and nesting far past the JSON depth limit.
"""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from http_helpers import MODEL, HttpGateway
from http_helpers import chat_models  # noqa: F401 (a fixture)
from services_helpers import wait_until
from services_helpers import tiny_models  # noqa: F401 (a fixture)

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
