"""OpenAI-grade controls through both public APIs equal a server without speculation: logprobs, the
penalties (presence, frequency, repetition), min_tokens with stop_token_ids, logit_bias and
grammar-constrained output (a JSON schema), greedy and seeded, sent over HTTP (`/v1/completions`) and
over gRPC (`Generate`) to a speculating server (a draft model; a random EAGLE head), give the tokens
and logprobs a `--draft none` server (what `--no-speculation` builds) gives for the same request. The
controls apply at every drafted position with the drafts before it counted as generated
(model.logits_controls); an engine that dropped them there would draft, verify and keep a token plain
decoding would not choose, and these tests see it with the draft model (the control changes the
output here: each case checks the controlled output differs from the uncontrolled one). A random
EAGLE head's drafts are verified but seldom accepted (none greedy, a few seeded), so its cases check
the serving path and the equality, and would see a broken control only where a draft is kept."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_cases import write_head  # noqa: E402
from engine_helpers import write_char_models  # noqa: E402
from http_helpers import MODEL, HttpGateway  # noqa: E402
from services_helpers import Client  # noqa: E402

from verifypd.v1 import generate_pb2  # noqa: E402

PROMPT = "abcabcabd ok "
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "word": {"type": "string", "pattern": "^[a-h]{6}$"}},
    "required": ["ok", "word"],
    "additionalProperties": False,
}
# (name, OpenAI body fields, SamplingParams fields): the same control in each API's spelling.
REP, FREQ = {"repetition_penalty": 3.0}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}
NEG = {"presence_penalty": -2.0, "repetition_penalty": 0.7}
# stop ids generated early without min_tokens (greedy: 72, seeded: 75), so the mask binds
MIN = {"min_tokens": 8, "stop_token_ids": [72, 75, 124, 6]}
CONTROLS = [
    ("rep", REP, REP),
    ("freq", FREQ, FREQ),
    ("neg", NEG, NEG),
    ("bias", {"logit_bias": {"72": -100, "90": 3.0}}, {"logit_bias": {72: -100, 90: 3.0}}),
    ("min", MIN, MIN),
]
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.9, "seed": 29}}


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    return write_char_models(tmp_path_factory.mktemp("equality"))


@pytest.fixture(scope="module")
def plain(char_models):
    """The reference: no draft at all (`--no-speculation` resolves to `--draft none`)."""
    s = HttpGateway((char_models[0], "none"), k=4)
    yield s
    s.stop()


@pytest.fixture(scope="module", params=["model", "eagle"])
def spec(request, char_models, tmp_path_factory):
    """Speculating servers: a draft model and a random EAGLE head, drafts that always propose. (The CPU's
    default draft, prompt lookup, proposes only where the context repeats, which the penalties here
    suppress: most of these requests would not speculate at all; test_gateway_structured_sampling.py
    covers it with a JSON schema.)"""
    draft = char_models[1]
    if request.param == "eagle":
        draft = write_head(char_models, tmp_path_factory.mktemp("equality_head") / "head")
    s = HttpGateway((char_models[0], draft), k=4)
    yield s
    s.stop()


def http(server, max_tokens: int = 20, **body) -> tuple[list[int], list[tuple], dict]:
    """(token ids, [(token id, logprob, top token ids)], usage) of one /v1/completions request."""
    import httpx

    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **body}
    r = httpx.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    done = r.json()
    ids = done["verifypd"]["token_ids"]
    lp = done["choices"][0]["logprobs"]
    rows = []
    if lp is not None:  # the legacy shape names tokens by text: top tokens as their texts, best first
        tops = lp["top_logprobs"] or [{}] * len(ids)
        rows = [(t, v, list(top)) for t, v, top in zip(ids, lp["token_logprobs"], tops, strict=True)]
    return ids, rows, done["usage"]


def grpc_generate(server, max_tokens: int = 20, constraint=None, **sampling) -> tuple[list[int], list[tuple], dict]:
    """The same request over gRPC: (token ids, [(token id, logprob, top token ids)], usage)."""
    client = Client(server.gw.address)
    try:
        pb_sampling = generate_pb2.SamplingParams(**sampling)
        fields = dict(text=PROMPT, max_tokens=max_tokens, stop_at_eos=False, sampling=pb_sampling)
        if constraint is not None:
            fields.update(constraint=constraint, stop_at_eos=True)
        ids, msgs = client.generate(**fields)
    finally:
        client.close()
    rows = [(lp.token_id, lp.logprob, [t.token_id for t in lp.top]) for m in msgs for lp in m.logprobs]
    usage = msgs[-1].usage
    return ids, rows, {"draft_tokens": usage.draft_tokens, "accepted_tokens": usage.accepted_tokens}


def assert_logprobs_equal(got: list[tuple], ref: list[tuple], ids: list[int]) -> None:
    assert [r[0] for r in got] == ids == [r[0] for r in ref]
    for (_, a, top_a), (_, b, top_b) in zip(got, ref, strict=True):
        assert a <= 0 and math.isclose(a, b, abs_tol=1e-5)  # float32: verify calls of other shapes round
        assert top_a == top_b


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("name,body,fields", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_controls_equal_no_speculation_over_grpc(spec, plain, name, body, fields, sampling):
    base = SAMPLINGS[sampling]
    ids, _, usage = grpc_generate(spec, **fields, **base)
    ref, _, _ = grpc_generate(plain, **fields, **base)
    assert ids == ref, name
    assert usage["draft_tokens"] > 0  # speculation ran: drafts were proposed and verified
    assert grpc_generate(plain, **base)[0] != ref, "the control changed nothing: a broken one would pass"


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("name,body,fields", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_controls_equal_no_speculation_over_http(spec, plain, name, body, fields, sampling):
    base = SAMPLINGS[sampling]
    ids, _, usage = http(spec, **body, **base)
    ref, _, _ = http(plain, **body, **base)
    assert ids == ref, name
    assert usage["verifypd"]["draft_tokens"] > 0
    # one request, two APIs, one engine: the same tokens
    assert ids == grpc_generate(spec, **fields, **base)[0]


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_logprobs_equal_no_speculation_over_both_apis(spec, plain, sampling):
    base = SAMPLINGS[sampling]
    controls = {"frequency_penalty": 0.8, "logit_bias": {70: 2.0}}
    ids, rows, _ = grpc_generate(spec, logprobs=True, top_logprobs=3, **controls, **base)
    ref, ref_rows, _ = grpc_generate(plain, logprobs=True, top_logprobs=3, **controls, **base)
    assert ids == ref and len(rows) == len(ids) == 20
    assert_logprobs_equal(rows, ref_rows, ids)
    body = {"frequency_penalty": 0.8, "logit_bias": {"70": 2.0}}
    h_ids, h_rows, _ = http(spec, logprobs=3, **body, **base)
    h_ref, h_ref_rows, _ = http(plain, logprobs=3, **body, **base)
    assert h_ids == h_ref == ids
    assert_logprobs_equal(h_rows, h_ref_rows, h_ids)
    for (_, a, _), (_, b, _) in zip(h_rows, rows, strict=True):  # HTTP reports what gRPC does
        assert math.isclose(a, b, abs_tol=1e-5)


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_grammar_with_penalty_and_logprobs_equals_no_speculation_over_both_apis(spec, plain, sampling):
    base = SAMPLINGS[sampling]
    constraint = generate_pb2.OutputConstraint(json_schema=json.dumps(SCHEMA))
    kwargs = dict(max_tokens=60, constraint=constraint, presence_penalty=1.5, logprobs=True, top_logprobs=2)
    ids, rows, usage = grpc_generate(spec, **kwargs, **base)
    ref, ref_rows, _ = grpc_generate(plain, **kwargs, **base)
    assert ids == ref and usage["draft_tokens"] > 0
    assert_logprobs_equal(rows, ref_rows, ids)
    text = spec.gw.codec.decode([t for t in ids if t != 2])
    jsonschema.validate(json.loads(text), SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    body = dict(max_tokens=60, response_format=fmt, presence_penalty=1.5, logprobs=2, ignore_eos=False)
    h_ids, h_rows, _ = http(spec, **body, **base)
    h_ref, h_ref_rows, _ = http(plain, **body, **base)
    assert h_ids == h_ref == ids
    assert_logprobs_equal(h_rows, h_ref_rows, h_ids)
    if not base:  # the penalty binds under the mask: without it the output differs
        unpenalised = dict(kwargs, presence_penalty=0.0)
        assert grpc_generate(plain, **unpenalised)[0] != ref
