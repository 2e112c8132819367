"""Structured output with sampling controls and logprobs in one request, through the HTTP API with the
official client: a json_schema response_format, logprobs (top 2) and a presence penalty, speculating
with `self:1` and with prompt lookup, gives the tokens and logprobs of the same request with
speculation disabled (greedy and seeded), and its output validates against the schema. The mask sits
after the penalty and before temperature (domain.sampling_controls step 5) on every verified position."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_helpers import write_char_models  # noqa: E402
from http_helpers import CHAT_TEMPLATE, MODEL, HttpGateway  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "word": {"type": "string", "pattern": "^[a-h]{10}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["ok", "word", "n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    return write_char_models(tmp_path_factory.mktemp("char_chat"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module", params=["self:1", "ngram"])
def server(request, char_models):
    s = HttpGateway((char_models[0], request.param), k=4)
    s.draft = request.param
    yield s
    s.stop()


def chat(client, speculate: bool, presence_penalty: float = 1.5, **sampling):
    extra = {} if speculate else {"speculation": {"disable": True}}
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=80,
        response_format=FORMAT,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=presence_penalty,
        extra_body=extra,
        **sampling,
    )


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 23}], ids=["greedy", "seeded"])
def test_json_schema_with_logprobs_and_penalty_equals_no_speculation(server, sampling):
    client = server.openai()
    spec, plain = chat(client, True, **sampling), chat(client, False, **sampling)
    ids, ref_ids = (r.model_extra["verifypd"]["token_ids"] for r in (spec, plain))
    assert ids == ref_ids
    text = spec.choices[0].message.content
    assert text == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    content, ref = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert len(content) == len(ref) == len(ids)  # one per token, EOS included
    for a, b in zip(content, ref, strict=True):
        assert a.token == b.token and a.logprob <= 0
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)  # float32, verify shapes differ
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert len(a.top_logprobs) == 2
    if not sampling:  # the penalty binds under the mask: without it this model writes other digits
        assert chat(client, True, presence_penalty=0).model_extra["verifypd"]["token_ids"] != ids
    if server.draft == "self:1":  # a draft that always proposes: drafts were verified
        assert spec.usage.model_extra["verifypd"]["draft_tokens"] > 0
