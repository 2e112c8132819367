"""The streamed chunk events of the HTTP API (gateway/http_api.ChunkEvents) are byte for byte the
JSON of the envelope they stand for, whatever the text (quotes, backslashes, control characters,
non-ASCII, emoji), finish reason, token ids, chat or completion, with or without usage."""

from __future__ import annotations

import json
import random

import pytest

from verifypd.gateway.http_completion import ChunkEvents, sse

TEXTS = [
    "",
    "Paris",
    ' "quoted" \\ back',
    "tab\tnew\nline\r\x00\x1f",
    "déjà vu – ü",
    "🙂 emoji",
    "</script>",
    "\u2028\u2029",
    "a" * 300,
]


def envelope_event(head: dict, chat: bool, include_usage: bool, text, reason, ids, k) -> bytes:
    """What the event is: the full envelope through json.dumps, as the non-streamed paths build it."""
    choice = (
        {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    )
    extra = {"usage": None} if include_usage else {}
    return sse({**head, "choices": [choice], **extra, "verifypd": {"token_ids": ids, "applied_k": k}})


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_chunk_events_equal_the_envelope_json(chat, include_usage):
    rng = random.Random(7)
    head = {
        "id": 'chatcmpl-1f"x',
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1732456789,
        "model": 'm/ö"del',
        "system_fingerprint": "verifypd-0.1",
    }
    events = ChunkEvents(head, chat, include_usage)
    for text in TEXTS + ["".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(20)) for _ in range(50)]:
        for reason in (None, "stop", "length"):
            ids = [rng.randrange(0, 128256) for _ in range(rng.randrange(0, 9))]
            k = rng.randrange(0, 9)
            got = events.event(text, reason, ids, k)
            assert got == envelope_event(head, chat, include_usage, text, reason, ids, k)
            assert json.loads(got[len(b"data: ") :])["verifypd"]["token_ids"] == ids
