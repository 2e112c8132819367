"""The tool-call parser (`tool_choice: auto` output, where a random model emits no calls): Hermes and
Llama 3 outputs give the calls and the content before them, fed whole or in any split (the stream's
deltas add up to the whole answer), a marker's first characters are never streamed as content, and
text that only looks like a call stays content."""

from __future__ import annotations

import json
import random

import pytest

from verifypd.gateway.tool_stream import ToolCallParser, delta_json, parse_all

NAMES = ("get_weather", "add")

HERMES_OUT = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and \\" inside"}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"a": 1, "b": [2.5, {"c": null}]}, "name": "add"}\n</tool_call>'
)
LLAMA_OUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "arguments": {"a": -3}}'
)


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(fmt: str, text: str, cuts: list[int], max_calls=None):
    """What a client rebuilds from the stream's deltas, the text fed in pieces cut at `cuts`."""
    parser = ToolCallParser(fmt, NAMES, max_calls)
    deltas, last = [], 0
    for cut in [*cuts, len(text)]:
        deltas += [delta_json(d) for d in parser.feed(text[last:cut])]
        last = cut
    deltas += [delta_json(d) for d in parser.finish()]
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["id"].startswith("call_") and tc["type"] == "function"
                calls.append({"id": tc["id"], "function": dict(tc["function"])})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return content or None, calls, deltas


def test_hermes_calls_and_content():
    content, calls = parse_all("hermes", NAMES, HERMES_OUT)
    assert content == "Let me check both."
    assert calls_of(calls) == [
        ("get_weather", {"city": "Paris", "note": 'a } and " inside'}),
        ("add", {"a": 1, "b": [2.5, {"c": None}]}),
    ]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "note": "a } and \\" inside"}'  # the model's text
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_llama3_calls():
    content, calls = parse_all("llama3", NAMES, LLAMA_OUT)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Oslo"}), ("add", {"a": -3})]
    content, calls = parse_all("llama3", NAMES, 'Sure: {"name": "add", "parameters": {"a": 7}}')
    assert content == "Sure:" and calls_of(calls) == [("add", {"a": 7})]


@pytest.mark.parametrize(("fmt", "text"), [("hermes", HERMES_OUT), ("llama3", LLAMA_OUT)])
def test_any_split_streams_the_whole_answer(fmt, text):
    whole_content, whole_calls = parse_all(fmt, NAMES, text)
    rng = random.Random(0)
    for trial in range(200):
        cuts = (
            list(range(1, len(text))) if trial == 0 else sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
        )
        content, calls, _ = streamed(fmt, text, cuts)
        assert content == whole_content
        assert calls_of(calls) == calls_of(whole_calls)
        assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole_calls]


def test_marker_prefix_is_held_back():
    text = 'Hello <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    _, _, deltas = streamed("hermes", text, list(range(1, len(text))))
    contents = [d["content"] for d in deltas if "content" in d]
    assert "".join(contents) == "Hello" and not any("<" in c for c in contents)
    # arguments stream as they come: several pieces, before the call's end
    assert sum(1 for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]) > 3


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", "a < b, and <tool is not <tool_call"),  # a prefix held to the end is content
        ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'),
        ("hermes", "<tool_call>not json</tool_call> then text  \n"),
        ("llama3", 'The answer is {"x": 1} and {"name": 5}.'),
        ("llama3", '{"name": "nope", "parameters": {}}'),
    ],
)
def test_text_that_is_no_call_stays_content(fmt, text):
    content, calls = parse_all(fmt, NAMES, text)
    assert calls == [] and content == text
    assert streamed(fmt, text, list(range(1, len(text))))[0] == text


def test_parallel_false_keeps_the_first_call():
    content, calls = parse_all("hermes", NAMES, HERMES_OUT, max_calls=1)
    assert content == "Let me check both." and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_a_cut_call_keeps_what_it_has():
    content, calls = parse_all("hermes", NAMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1'}
    content, calls = parse_all("hermes", NAMES, '<tool_call>\n{"name": "add"}\n</tool_call>')
    assert calls[0]["function"] == {"name": "add", "arguments": "{}"}
