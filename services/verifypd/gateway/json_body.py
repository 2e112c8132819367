"""Parsing of untrusted JSON request bodies with limits. Torch-free.

The body's size is bounded by the HTTP layer (413 past `max_body_bytes`); here the *shape* is:

* nesting depth <= MAX_JSON_DEPTH. An OpenAI request nests 5 deep (body / messages / message /
  content parts / part); Python's decoder recurses per level and raises RecursionError ~1,000 deep,
  which must not surface as a 500. Deeper bodies get a 400 naming the limit.
* text that protobuf can carry: strings with lone UTF-16 surrogates ("\\ud800" is valid JSON but not
  encodable as UTF-8) get a 400 quoting where, instead of failing in the wire conversion (a 500).
"""

from __future__ import annotations

import json
import re

MAX_JSON_DEPTH = 32
# A UTF-16 surrogate can only reach a decoded string through a \\uD800-\\uDFFF escape (raw
# surrogate bytes are not UTF-8, so the decoder refuses them already).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class JsonBodyError(ValueError):
    """A body refused before its fields are looked at; `code` is the OpenAI-style error code."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def too_deep() -> JsonBodyError:
    return JsonBodyError(
        f"the request body nests deeper than the JSON depth limit ({MAX_JSON_DEPTH} levels of objects and arrays)",
        "json_too_deep",
    )


def parse_json_body(body: bytes | bytearray):
    """The decoded body, or JsonBodyError (not JSON, too deep, unencodable text)."""
    # Cheap bound first: a body with at most MAX_JSON_DEPTH brackets cannot nest deeper.
    brackets = body.count(b"[") + body.count(b"{")
    try:
        value = json.loads(body)
    except RecursionError:
        raise too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonBodyError(f"the request body is not valid JSON: {exc}") from None
    texts = _SURROGATE_ESCAPE.search(body) is not None
    if brackets > MAX_JSON_DEPTH or texts:
        check_shape(value, texts=texts)
    return value


def check_shape(value, texts: bool = True) -> None:
    """Raises JsonBodyError if `value` nests deeper than MAX_JSON_DEPTH or (`texts`) holds text UTF-8
    cannot carry. Iterative: a recursive walk would meet the recursion limit it is guarding against."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if texts:
                _check_text(node)
            continue
        if not isinstance(node, (list, dict)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        if isinstance(node, dict):
            for key, child in node.items():
                if texts:
                    _check_text(key)
                if isinstance(child, (str, list, dict)):
                    stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in node if isinstance(child, (str, list, dict)))


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise JsonBodyError(
            f"the request body holds text that is not valid Unicode ({exc.reason} at character "
            f"{exc.start} of {text[: exc.start][-20:]!r}...): lone UTF-16 surrogates are not "
            "allowed",
            "invalid_text",
        ) from None
