"""Tool calling in the OpenAI API with the official client, on the char-level tiny model: a named
function or tool_choice "required" gives calls whose arguments validate against the function's
schema, streamed or not (the stream's deltas add up to the same calls), with speculation on and equal
to it off, in the Hermes and the Llama 3 format; tool history renders through a template without tool
support (the generic system message) and one with it; bad tool input is a 400 naming the field."""

from __future__ import annotations

import json
import pathlib

import openai
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_helpers import write_char_models  # noqa: E402
from http_helpers import CHAT_TEMPLATE, MODEL, HttpGateway  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "user", "content": "And in Lima?"},
]
# A template that renders tools, calls and results itself (Hermes-style, as Qwen's does).
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['city'] }})</tool_call>{% endfor %}"
    "{% elif m['role'] == 'tool' %}<tool_response>{{ m['tool_call_id'] }}={{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}assistant: "
)


CONTEXT = 2048  # a char-level prompt with the generic tools system message is ~1,000 tokens


def long_context_char_models(root) -> tuple[str, str]:
    models = write_char_models(root, chat_template=CHAT_TEMPLATE)
    for path in models:  # (RoPE: any position works; the config's 256 is the test default)
        config = pathlib.Path(path) / "config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"max_position_embeddings": CONTEXT}))
    return models


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    models = long_context_char_models(tmp_path_factory.mktemp("char_tools"))
    s = HttpGateway(models, max_context=CONTEXT, num_blocks=2 * CONTEXT // 16, block_size=16)
    yield s
    s.stop()


@pytest.fixture
def client(gateway):
    return gateway.openai()


def call(client, stream=False, messages=None, **kwargs):
    """(content, [(name, arguments)], finish_reason, [call ids]) of one chat request."""
    messages = messages or [{"role": "user", "content": "Weather in Paris?"}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 240, "tools": TOOLS} | kwargs
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason, [c.id for c in m.tool_calls or []]
    content, calls, ids, finish = "", [], [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # a call's first delta: id, type, name
                assert tc.index == len(calls) and tc.type == "function"
                calls.append((tc.function.name, tc.function.arguments or ""))
                ids.append(tc.id)
            else:
                name, arguments = calls[tc.index]
                calls[tc.index] = (name, arguments + tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content or None, calls, finish, ids


def valid(calls):
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [None, 7])
def test_named_function_validates_and_equals_no_speculation(client, stream, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    content, calls, finish, ids = call(client, stream, tool_choice=NAMED, **sampling)
    assert finish == "tool_calls" and content is None
    assert [name for name, _ in calls] == ["get_weather"]
    assert ids[0].startswith("call_") and len(ids[0]) > 10
    valid(calls)
    plain = call(client, stream, tool_choice=NAMED, extra_body={"speculation": {"disable": True}}, **sampling)
    assert plain[:3] == (content, calls, finish)
    other = call(client, not stream, tool_choice=NAMED, **sampling)  # streamed == whole
    assert other[:3] == (content, calls, finish)


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_of_the_tools(client, stream):
    content, calls, finish, _ = call(
        client, stream, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
    )
    assert finish == "tool_calls" and content is None and len(calls) == 1
    valid(calls)
    content, calls, finish, ids = call(client, stream, tool_choice="required", temperature=1.0, seed=11)
    assert calls and finish in ("tool_calls", "length")
    valid(calls if finish == "tool_calls" else calls[:-1])  # (length may cut the last call)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_format(gateway, client, stream):
    gateway.api.tool_parser = "llama3"
    try:
        content, calls, finish, _ = call(client, stream, tool_choice={"type": "function", "function": {"name": "add"}})
        raw = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            max_tokens=240,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
    finally:
        gateway.api.tool_parser = "auto"
    assert finish == "tool_calls" and content is None and [n for n, _ in calls] == ["add"]
    valid(calls)
    token_ids = raw.model_extra["verifypd"]["token_ids"]  # the raw output: Llama's JSON, no tags
    text = "".join(chr(t + 29) for t in token_ids if 3 <= t < 98)
    assert text.startswith('{"name": "add", "parameters": {"a": ')


def test_auto_and_none_do_not_constrain(client):
    """A random model calls no tool of its own: auto answers text (finish stop/length), and none too."""
    for choice in ("auto", "none"):
        content, calls, finish, _ = call(client, tool_choice=choice, max_tokens=12)
        assert calls == [] and finish in ("stop", "length") and isinstance(content, str)


@pytest.mark.parametrize("stream", [False, True])
def test_history_with_tool_messages_renders_generic(client, stream):
    content, calls, finish, _ = call(client, stream, messages=HISTORY, tool_choice=NAMED)
    assert finish == "tool_calls"
    valid(calls)


def test_generic_rendering_holds_tools_calls_and_results(gateway):
    from verifypd.gateway import tool_render, tools
    from verifypd.v1 import generate_pb2

    req = tools.parse({"messages": HISTORY, "tools": TOOLS})
    pb = generate_pb2.GenerateRequest()
    tool_render.render(req, gateway.gw.codec, pb)
    text = gateway.gw.codec.tokenizer.decode(list(pb.token_ids.ids))
    assert req.parser == tools.HERMES and not pb.HasField("constraint")
    assert text.startswith("Be brief.\n\n# Tools")  # one system message: the user's, then the tools
    assert json.dumps(TOOLS[0]) in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_native_template_renders_tools_and_history(tmp_path):
    from engine_helpers import write_char_tokenizer
    from transformers import AutoTokenizer

    from verifypd.domain.tokenizer import TextCodec
    from verifypd.gateway import tool_render, tools
    from verifypd.v1 import generate_pb2

    codec = TextCodec(AutoTokenizer.from_pretrained(write_char_tokenizer(tmp_path, TOOLS_TEMPLATE)))
    req = tools.parse({"messages": HISTORY, "tools": TOOLS, "tool_choice": "required"})
    pb = generate_pb2.GenerateRequest()
    tool_render.render(req, codec, pb)
    text = codec.tokenizer.decode(list(pb.token_ids.ids))
    assert text == (
        "<tools>get_weather add </tools>\nsystem: Be brief.\nuser: Weather in Oslo?\n"
        "assistant: <tool_call>get_weather(Oslo)</tool_call>\ntool: <tool_response>call_1=sunny, 21 C</tool_response>\n"
        "user: And in Lima?\nassistant: "
    )
    assert req.parser == tools.HERMES and pb.constraint.grammar.startswith("start: tagged")


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD, ids=[p for _, p in BAD])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_input_is_400_naming_the_field(client, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as err:
        call(client, stream, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    if not stream:  # the server goes on serving
        _, calls, finish, _ = call(client, tool_choice=NAMED)
        assert finish == "tool_calls"
        valid(calls)


def test_engine_refusal_of_the_calls_grammar_names_tool_choice():
    """The engine's refusals name the wire's `constraint` (split topology, no tokenizer); for a
    forcing tool_choice the 400 names tool_choice, not response_format."""
    from verifypd.gateway import openai_convert as oc

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": NAMED}
    parsed = oc.parse_request(body, oc.CHAT, request_id="r")
    message = "constraint.grammar: structured output needs the colocated topology (in-process lanes)"
    assert oc.openai_param(message, parsed) == ("tool_choice", message)
    parsed = oc.parse_request(body | {"tool_choice": "auto"}, oc.CHAT, request_id="r")
    assert oc.openai_param(message, parsed)[0] == "response_format"
