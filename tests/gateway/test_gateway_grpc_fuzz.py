"""Generate requests with extreme field values: each is served or refused with
INVALID_ARGUMENT naming the field, never INTERNAL/UNKNOWN or a hang, and nothing leaks."""

from __future__ import annotations

import random

import grpc
import pytest
from services_helpers import (
    Client,
    engine_options,
    wait_until,
)

from verifypd.v1 import generate_pb2 as pb

FUZZ_REQUESTS = 1500
NAN, INF = float("nan"), float("inf")

# (field, hostile values, words one of which the INVALID_ARGUMENT message must hold). A value the
# server accepts (e.g. top_k 2^31-1, temperature 1e30) must simply be served.
HOSTILE = [
    ("max_tokens", [1, 2**32 - 1], ["max_tokens"]),
    ("sampling.temperature", [NAN, INF, -INF, -1.0, -0.0, 1e-45, 3.4e38, 1e30], ["temperature"]),
    ("sampling.top_p", [NAN, INF, -INF, -0.5, 1.0000001, 2.0, 1e-45, 0.0], ["top_p"]),
    ("sampling.top_k", [2**31 - 1, -(2**31), -1, 1], ["top_k"]),
    ("sampling.seed", [0, 2**64 - 1], ["seed"]),
    ("stop", [[""], ["x"] * 17, ["x"] * 10_000, ["x" * 257], ["y" * 100_000], ["\x00"], ["\ud7ff", "é"]], ["stop"]),
    ("text", ["", "w5 " * 100_000, "\x00", "é" * 1000], ["text", "prompt"]),
    ("token_ids", [[], [2**32 - 1], [96], [95], [0] * 10_000, [5] * 255], ["token_ids", "prompt"]),
    ("chat", [[], [("robot", "w5")], [("user", "w5" * 50_000)]], ["chat", "prompt", "tokenizer", "template"]),
    ("request_id", ["r" * 300, "\x00", "é" * 10], ["request_id"]),
    ("priority", [2**31 - 1, -(2**31), 101, -100], ["priority"]),
    ("speculation.max_k", [2**32 - 1, 17, 0, 16], ["max_k", "k "]),
    ("speculation.disable", [True, False], ["speculation"]),
]


@pytest.fixture(scope="module")
def gateway(tiny_models):
    from verifypd.gateway.server import build_colocated

    gw = build_colocated(engine_options(*tiny_models), max_queue=4096).start()
    yield gw
    gw.stop()


def set_field(req: pb.GenerateRequest, field: str, value) -> None:
    if field == "token_ids":
        req.token_ids.ids[:] = value
    elif field == "chat":
        req.chat.SetInParent()
        for role, content in value:
            req.chat.messages.add(role=role, content=content)
    elif field == "stop":
        req.stop[:] = value
    else:
        *path, name = field.split(".")
        target = req
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)


def hostile_request(rng: random.Random, n: int) -> tuple[pb.GenerateRequest, list[str], list[str]]:
    """A valid small request with 1-3 fields made hostile; returns it and the fields and words."""
    req = pb.GenerateRequest(
        request_id=f"f{n}",
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        max_tokens=rng.randint(1, 3),
        sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=n),
    )
    fields, words = [], []
    for field, values, names in rng.sample(HOSTILE, rng.choice([1, 1, 1, 2, 3])):
        set_field(req, field, rng.choice(values))
        fields.append(field)
        words += names
    return req, fields, words


def call(client: Client, req: pb.GenerateRequest):
    try:
        msgs = list(client.gen.Generate(req, timeout=30))
        return grpc.StatusCode.OK, "", msgs
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []


@pytest.mark.slow
def test_extreme_field_values_are_served_or_invalid_argument_naming_the_field(gateway):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(23)
    requests = [hostile_request(rng, n) for n in range(FUZZ_REQUESTS)]
    client = Client(gateway.address)
    try:  # a hang is a call's 30 s deadline (DEADLINE_EXCEEDED fails below), not a bound on the whole run
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda r: call(client, r[0]), requests))
    finally:
        client.close()
    codes = {}
    for (req, fields, words), (code, details, msgs) in zip(requests, answers):
        what = f"{code.name} {details!r} for {fields}: {str(req)[:300]}"
        codes[code.name] = codes.get(code.name, 0) + 1
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), what
        assert "Traceback" not in details, what
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert any(w in details for w in words), what
        else:
            assert msgs and msgs[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED, what
            assert all(t < 96 for m in msgs for t in m.token_ids), what
    assert codes.get("OK", 0) > FUZZ_REQUESTS // 5 and codes.get("INVALID_ARGUMENT", 0) > FUZZ_REQUESTS // 5, codes
    blocks = lambda: gateway.core_loop.call(lambda r: (r.target_blocks.num_used, r.draft_blocks.num_used))  # noqa: E731
    assert wait_until(lambda: blocks() == (0, 0), timeout_s=30), blocks()
    assert wait_until(lambda: gateway.client.in_flight() == 0, timeout_s=30)
