"""Structured output in the OpenAI API, with the official client: response_format json_schema /
json_object and guided_regex give output that parses and validates, streamed or not, with speculation
on and equal to it off; every malformed constraint is a 400 naming the parameter, and the server
goes on serving."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_helpers import write_char_models  # noqa: E402
from http_helpers import CHAT_TEMPLATE, MODEL, HttpGateway  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = HttpGateway(write_char_models(tmp_path_factory.mktemp("char_chat"), chat_template=CHAT_TEMPLATE))
    yield s.openai()
    s.stop()


def chat(client, stream=False, **kwargs):
    messages = [{"role": "user", "content": "Answer in JSON."}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, **kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, stream=True, **kwargs)
    text, finish = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [None, 7])
def test_json_schema_validates_and_equals_no_speculation(client, stream, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    text, finish = chat(client, stream, response_format=FORMAT, **sampling)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    plain, _ = chat(client, stream, response_format=FORMAT, extra_body={"speculation": {"disable": True}}, **sampling)
    assert plain == text


def test_json_object_and_guided_regex(client):
    text, finish = chat(client, response_format={"type": "json_object"})
    # (a random model may write one key until max_tokens: then a JSON object's prefix)
    assert isinstance(json.loads(text), dict) if finish == "stop" else text.startswith('{"')
    small = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    text, finish = chat(client, extra_body={"guided_json": small | {"additionalProperties": False}})
    assert finish == "stop" and 0 <= json.loads(text)["n"] <= 99
    r = client.completions.create(
        model=MODEL, prompt="id:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: foo("}}, "guided_grammar"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_naming_the_parameter(client, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, stream, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    text, finish = chat(client, response_format=FORMAT)  # the server goes on serving
    jsonschema.validate(json.loads(text), SCHEMA)
