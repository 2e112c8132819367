"""`verifypd distill`'s own chat requests (distill.chat_requests): none of the held-out evaluation
prompts can come out of the templates, and the mix of request kinds is what the module says
(seeded, deterministic, dealt round robin). Torch-free."""

from __future__ import annotations

import json
import pathlib
import re
from collections import Counter

from verifypd.distill.chat_requests import KINDS, WRITER_KINDS, every_template_request, template_requests, writer_asks

EVAL = pathlib.Path(__file__).resolve().parents[2] / "bench" / "prompts" / "draft_acceptance.jsonl"


def normal(text: str) -> str:
    return " ".join(text.lower().split())


def words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


def test_no_evaluation_prompt_can_be_produced_by_the_templates():
    """bench/prompts/draft_acceptance.jsonl is the held-out evaluation: no template expansion equals
    one of its prompts (case and whitespace normalised), nor shares 80 % of its words with one."""
    held_out = [json.loads(line)["prompt"] for line in EVAL.read_text().splitlines() if line.strip()]
    assert len(held_out) == 96
    exact = {normal(p) for p in held_out}
    near = [words(p) for p in held_out if len(words(p)) <= 12]  # the short (chat) prompts
    produced = 0
    for request in every_template_request():
        produced += 1
        assert normal(request) not in exact, request
        mine = words(request)
        for theirs in near:
            assert len(mine & theirs) / len(mine | theirs) < 0.8, (request, sorted(theirs))
    assert produced > 3000  # the enumeration covers the pools


def test_template_requests_deal_every_kind_evenly_and_repeat_for_a_seed():
    first = template_requests(1000, seed=3)
    assert first == template_requests(1000, seed=3)  # deterministic
    assert first != template_requests(1000, seed=4)
    counts = Counter(kind for kind, _ in first)
    assert set(counts) == set(KINDS) and len(KINDS) == 16
    assert sorted(counts.values()) == [62] * 8 + [63] * 8  # 1000 = 16 * 62 + 8
    assert len({text for _, text in first}) > 900  # varied, not a few repeated
    assert all("{" not in text and "}" not in text for _, text in first)  # every slot filled
    shapes = {
        kind: [re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(t)) + "$") for t in ts] for kind, ts in KINDS.items()
    }
    assert all(any(shape.match(text) for shape in shapes[kind]) for kind, text in first)  # each of its kind
    assert len(template_requests(5, seed=0)) == 5 and len({k for k, _ in template_requests(5, seed=0)}) == 5


def test_writer_asks_cover_every_kind_for_the_target_to_write():
    asks = writer_asks(240, seed=1)
    assert asks == writer_asks(240, seed=1)
    counts = Counter(next(kind for kind in WRITER_KINDS if f"Write {kind} that" in a) for a in asks)
    assert set(counts.values()) == {240 // len(WRITER_KINDS)}
    assert len(set(asks)) > 150
