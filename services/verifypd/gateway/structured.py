"""Structured output in the OpenAI API: `response_format` and the vLLM-style extensions
`guided_json`, `guided_regex`, `guided_grammar` -> the wire's OutputConstraint. Torch-free.

Each is checked here with the grammar engine (verifypd.domain.grammar), so a bad schema, regex or
grammar is a 400 naming the parameter the client sent, before the request reaches the engine.
"""

from __future__ import annotations

import json
import re

from verifypd.domain import grammar
from verifypd.domain.requests import Constraint, InvalidRequest
from verifypd.gateway.errors import bad
from verifypd.v1 import generate_pb2

GUIDED = ("guided_json", "guided_regex", "guided_grammar")
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def constraint_of(body: dict) -> generate_pb2.OutputConstraint | None:
    """The request's constraint (None: free text); a 400 naming the parameter if it is malformed."""
    found: list[tuple[str, Constraint]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        c = _response_format(response_format)
        if c is not None:
            found.append(("response_format", c))
    for name in GUIDED:
        value = body.get(name)
        if value is not None:
            found.append((name, _guided(name, value)))
    if len(found) > 1:
        raise bad(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: give one of them")
    if not found:
        return None
    param, c = found[0]
    try:
        grammar.check(c)
    except InvalidRequest as exc:
        raise bad(param, str(exc)) from None
    return to_pb(c)


def to_pb(c: Constraint) -> generate_pb2.OutputConstraint:
    if c.kind == "json":
        return generate_pb2.OutputConstraint(json_object=True)
    pb = generate_pb2.OutputConstraint()
    setattr(pb, c.kind, c.text)  # json_schema, regex or grammar: the oneof's string forms
    return pb


def _response_format(value) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad("response_format", "response_format must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", "", "response_format")
    if kind != "json_schema":
        raise bad("response_format", f"response_format.type must be text, json_object or json_schema; got {kind!r:.40}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format", "response_format.json_schema must be an object {name, schema, strict}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad(
            "response_format",
            "response_format.json_schema.name must be 1-64 letters, digits, underscores or dashes",
        )
    if not isinstance(spec.get("strict", False), bool):
        raise bad("response_format", "response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format", "response_format.json_schema.schema must be a JSON schema object")
    return Constraint("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def _guided(name: str, value) -> Constraint:
    if name == "guided_json":
        if isinstance(value, str):
            return Constraint("json_schema", value, name)
        if isinstance(value, dict):
            return Constraint("json_schema", json.dumps(value), name)
        raise bad(name, f"{name} must be a JSON schema (an object or its JSON text)")
    if not isinstance(value, str):
        raise bad(name, f"{name} must be a string")
    return Constraint("regex" if name == "guided_regex" else "grammar", value, name)
