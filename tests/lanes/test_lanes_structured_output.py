"""Structured output through speculation (domain.grammar, model.token_mask, the router's k + 1 masks per
verify step): over a tiny char-level model, constrained output parses and validates, and equals decoding
without speculation under greedy and seeded sampling, with a noisy draft model, a self:N draft and
prompt lookup. The draft never sees the mask: a draft the grammar forbids is rejected by the masked choice."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from engine_helpers import make_engine, write_char_models  # noqa: E402

from verifypd.domain.requests import Constraint, RequestSpec, SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["ok", "colour", "n", "tags"],
    "additionalProperties": False,
}
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
]


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    return write_char_models(tmp_path_factory.mktemp("char"))


def run(engine, constraint, prompts, max_k, max_tokens=80):
    specs = [
        RequestSpec(
            tuple(engine.codec.encode(p)), max_tokens=max_tokens, sampling=s, constraint=constraint, max_k=max_k
        )
        for p in prompts
        for s in SAMPLINGS
    ]
    done = engine.generate(specs)
    return list(done.values())


@pytest.mark.parametrize("draft", ["model", "self:1", "ngram"])
def test_json_schema_output_validates_and_equals_plain_decoding(char_models, draft):
    target, noisy = char_models
    engine = make_engine(target, {"model": noisy, "self:1": "self:1", "ngram": "ngram"}[draft], k=4)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    prompts = ["Give JSON:", "{ab", "x"]
    plain = run(engine, c, prompts, max_k=0)
    spec = run(engine, c, prompts, max_k=4)
    assert [p.token_ids for p in plain] == [s.token_ids for s in spec]
    for out in spec:
        assert out.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert sum(s.usage["draft_tokens"] for s in spec) > 0  # it speculated


def test_regex_constraint_with_accepted_drafts(char_models):
    """A loose constraint (lowercase words) the unconstrained draft often meets: drafts are accepted and
    rejected, and the output still matches the regex and equals plain decoding."""
    target, noisy = char_models
    engine = make_engine(target, noisy, k=4)
    c = Constraint("regex", "[a-z ]{1,40}")
    plain = run(engine, c, ["hello", "abc"], max_k=0, max_tokens=41)
    spec = run(engine, c, ["hello", "abc"], max_k=4, max_tokens=41)
    assert [p.token_ids for p in plain] == [s.token_ids for s in spec]
    for out in spec:
        assert __import__("re").fullmatch("[a-z ]{1,40}", out.text), out.text
    usage = [s.usage for s in spec]
    assert sum(u["accepted_tokens"] for u in usage) > 0
    assert sum(u["draft_tokens"] - u["accepted_tokens"] for u in usage) > 0


def test_mask_changes_the_output_and_others_are_unaffected(char_models):
    """The constraint binds (unconstrained output differs and is not JSON), and an unconstrained request
    batched with constrained ones gets its plain output."""
    target, noisy = char_models
    engine = make_engine(target, noisy, k=4)
    prompt = tuple(engine.codec.encode("Give JSON:"))
    free = RequestSpec(prompt, max_tokens=30, max_k=4, request_id="free")
    alone = engine.generate([free])["free"]
    c = Constraint(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        ),
    )
    both = engine.generate([free, RequestSpec(prompt, max_tokens=60, max_k=4, constraint=c, request_id="json")])
    assert both["free"].token_ids == alone.token_ids
    assert isinstance(json.loads(both["json"].text)["ok"], bool)
    assert both["json"].text[:5] != alone.text[:5]


@pytest.mark.parametrize("draft", ["model", "self:1"])
def test_a_draft_that_ends_the_grammar_is_followed_by_eos(char_models, draft):
    """A short bounded grammar: drafts that complete it are kept, and the position after them may only
    be EOS (the matcher stops there): the output equals decoding without speculation, never a token
    past the grammar's end."""
    target, noisy = char_models
    engine = make_engine(target, {"model": noisy, "self:1": "self:1"}[draft], k=4)
    c = Constraint("regex", "[a-z]{1,3}")
    prompts = ["x", "hello", "abc", "zz"]
    plain = run(engine, c, prompts, max_k=0, max_tokens=20)
    spec = run(engine, c, prompts, max_k=4, max_tokens=20)
    assert [p.token_ids for p in plain] == [s.token_ids for s in spec]
    for out in spec:
        assert out.finish_reason == "eos" and __import__("re").fullmatch("[a-z]{1,3}", out.text), out.text
    assert sum(s.usage["accepted_tokens"] for s in spec) > 0  # drafts were kept


@pytest.mark.parametrize("draft", ["self:1", "ngram"])
def test_min_tokens_yields_to_the_end_of_the_grammar(char_models, draft):
    """min_tokens past the longest output the grammar allows: where it holds back the EOS that is all
    the finished grammar allows, the grammar wins (the request ends, its output matches), the same
    with speculation as without, and the engine goes on serving."""
    target, _ = char_models
    engine = make_engine(target, draft, k=4)
    c = Constraint("regex", "[a-z]{1,3}")
    outs = {}
    for max_k in (0, 4):
        specs = [
            RequestSpec(
                tuple(engine.codec.encode(p)),
                max_tokens=20,
                sampling=SamplingParams(min_tokens=10, presence_penalty=1.0, **s),
                constraint=c,
                max_k=max_k,
                request_id=f"{p}/{n}",
            )
            for p in ("x", "hello")
            for n, s in enumerate([{}, {"temperature": 1.0, "seed": 5}])
        ]
        outs[max_k] = engine.generate(specs)
    assert {r: o.token_ids for r, o in outs[0].items()} == {r: o.token_ids for r, o in outs[4].items()}
    for out in outs[4].values():
        assert out.finish_reason == "eos" and __import__("re").fullmatch("[a-z]{1,3}", out.text), out.text
    after = engine.generate([RequestSpec(tuple(engine.codec.encode("x")), max_tokens=5, request_id="after")])
    assert len(after["after"].token_ids) == 5
