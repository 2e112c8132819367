"""Tree drafting end to end (spec_decode.tree_decode): on a tiny random Llama, tree-drafted greedy and
seeded output equals `--no-speculation`'s (the router's plain decoding), with a model draft, `self:1`
and a random EAGLE head, on both attention backends; the accepted path's KV is moved into place
(a later step reads it), and trees are really accepted past their first node."""

from __future__ import annotations

import os
import random

import pytest
from engine_cases import write_head
from engine_helpers import VOCAB, make_engine

from verifypd.domain.draft_tree import TreeShape
from verifypd.domain.options import EngineOptions
from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.model.build import load_models
from verifypd.spec_decode.tree_decode import TreeDecoder

pytestmark = pytest.mark.slow  # engines over tiny checkpoints (tests/README.md)

MAX_TOKENS = 20
SEEDED = SamplingParams(temperature=1.2, seed=11)


def random_prompts(n: int, seed: int, max_len: int = 20) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, max_len))) for _ in range(n)]


def plain_outputs(target: str, prompts, sampling=None) -> list[list[int]]:
    engine = make_engine(target, "none", k=0)
    specs = [
        RequestSpec(tuple(p), max_tokens=MAX_TOKENS, stop_at_eos=False, **({"sampling": sampling} if sampling else {}))
        for p in prompts
    ]
    done = engine.generate(specs)
    return [c.token_ids for c in done.values()]


@pytest.fixture(scope="module")
def prompts():
    return [list(p) for p in random_prompts(6, seed=4)]


@pytest.fixture(scope="module")
def expected(tiny_models, prompts):
    return plain_outputs(tiny_models[0], prompts)


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    return write_head(tiny_models, tmp_path_factory.mktemp("tree_head") / "head")


def decoder(target: str, draft: str, shape: TreeShape, attention: str = "reference", graphs=False) -> TreeDecoder:
    old = os.environ.get("VERIFYPD_ATTENTION")
    os.environ["VERIFYPD_ATTENTION"] = attention
    try:
        models = load_models(EngineOptions(target=target, draft=draft, device="cpu", dtype="float32"))
    finally:
        if old is None:
            os.environ.pop("VERIFYPD_ATTENTION")
        else:
            os.environ["VERIFYPD_ATTENTION"] = old
    return TreeDecoder(models, shape, block_size=4, num_blocks=512, max_context=64, graphs=graphs)


@pytest.mark.parametrize("draft", ["model", "self:1", "eagle"])
@pytest.mark.parametrize("shape", [TreeShape(topk=2, budget=6, depth=4), TreeShape(topk=4, budget=20, depth=5)])
def test_tree_greedy_equals_plain(tiny_models, prompts, expected, head, draft, shape):
    spec = {"model": tiny_models[1], "self:1": "self:1", "eagle": head}[draft]
    out, stats = decoder(tiny_models[0], spec, shape).generate(prompts, MAX_TOKENS)
    assert out == expected
    # fewer verify passes than tokens: some tree nodes past the root were accepted
    assert stats.steps < sum(len(o) for o in out) - len(out)


@pytest.mark.parametrize("draft", ["model", "eagle"])
def test_tree_greedy_through_step_buffers_equals_plain(tiny_models, prompts, expected, head, draft):
    """The CUDA graphs' static-buffer path (run eagerly): inputs copied in, outputs read back, per batch size
    (the batch shrinks as requests finish at different steps)."""
    spec = {"model": tiny_models[1], "eagle": head}[draft]
    dec = decoder(tiny_models[0], spec, TreeShape(topk=3, budget=12, depth=4), graphs="eager")
    out, _ = dec.generate(prompts, MAX_TOKENS)
    assert out == expected
    assert len(dec.tree_step.captured) >= 2


def test_tree_greedy_on_triton_interpreter(tiny_models, prompts, expected, head):
    """The kernel's tree mode in the whole loop (target verify and the head's tree steps)."""
    out, _ = decoder(tiny_models[0], head, TreeShape(topk=2, budget=6, depth=3), "triton").generate(prompts[:2], 10)
    assert out == [e[:10] for e in expected[:2]]


@pytest.mark.parametrize("draft", ["model", "eagle"])
def test_tree_seeded_equals_plain(tiny_models, prompts, head, draft):
    spec = {"model": tiny_models[1], "eagle": head}[draft]
    want = plain_outputs(tiny_models[0], prompts, SEEDED)
    out, _ = decoder(tiny_models[0], spec, TreeShape(topk=3, budget=12, depth=4)).generate(prompts, MAX_TOKENS, SEEDED)
    assert out == want


def test_tree_decoder_refuses_a_poolless_draft(tiny_models):
    models = load_models(EngineOptions(target=tiny_models[0], draft="none", device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="draft-tree"):
        TreeDecoder(models, TreeShape())
