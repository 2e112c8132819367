"""Sliding-window KV (docs/engine.md "Sliding-window KV"): in a model whose every layer slides (Mistral),
a long generation holds only the blocks its window can still see (plus the ones being written), and
its output is still exactly transformers' greedy one (fp32), with and without speculation, with the
prefix cache sharing blocks that were released. A model mixing local and global layers (Gemma 2) keeps
every block; its pool says so (PoolInfo.window 0)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from engine_helpers import DEVICE, VOCAB, make_engine
from family_checkpoints import WINDOW, hf_greedy_through_eos, write_family

from verifypd.domain.requests import RequestSpec
from verifypd.router.block_manager import FREED

BLOCK = 4
NEW_TOKENS = 48
PROMPT = 11


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_family(tmp_path_factory.mktemp("mistral_window"), "mistral", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(7)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(PROMPT)) for _ in range(2)]
    return str(path), prompts, [hf_greedy_through_eos(hf, list(p), NEW_TOKENS) for p in prompts]


def run_tracking_blocks(engine, specs) -> tuple[dict[str, list[int]], int, int, int]:
    """Runs `specs` step by step: (token ids by request, most target blocks held at once, most draft
    blocks, most FREED entries seen in one table)."""
    router = engine.router
    ids = [router.add_request(s) for s in specs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    most_target = most_draft = most_freed = 0
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        ctx = router.context
        most_target = max(most_target, ctx.target_blocks.num_used)
        if ctx.draft_blocks is not None:
            most_draft = max(most_draft, ctx.draft_blocks.num_used)
        tables = [seq.target_blocks for seq in ctx.sequences.values()]
        most_freed = max([most_freed] + [sum(b == FREED for b in t) for t in tables])
        ctx.target_blocks.check(tables)
    return tokens, most_target, most_draft, most_freed


@pytest.mark.parametrize("draft,k", [("none", 0), ("self:1", 3), ("ngram", 3)])
def test_windowed_generation_holds_bounded_blocks_and_matches_transformers(mistral, draft, k):
    path, prompts, expected = mistral
    engine = make_engine(path, draft, k=k, k_max=k, block_size=BLOCK, max_context=128)
    assert engine.router.context.target_pool.window == WINDOW
    tokens, most_target, most_draft, most_freed = run_tracking_blocks(
        engine, [RequestSpec(prompts[0], max_tokens=NEW_TOKENS, stop_at_eos=False, request_id="a")]
    )
    assert tokens["a"] == expected[0]
    # Live positions: the window behind the pending token plus the k + 1 being verified.
    bound = -(-(WINDOW + k + 1) // BLOCK) + 1
    whole = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    assert most_target <= bound < whole
    assert most_freed >= whole - bound - 1
    if draft.startswith("self:"):  # the first layer of Mistral slides too: its pool is windowed
        assert 0 < most_draft <= bound
    assert engine.router.context.target_blocks.num_used == 0  # everything back at the end


def test_cached_prefix_whose_blocks_were_released(mistral):
    """The second request with the same prompt starts from the first's cached blocks, some of which
    were released out of the window (and stayed cached): still transformers' output."""
    path, prompts, expected = mistral
    engine = make_engine(path, "none", k=0, block_size=BLOCK, max_context=128)
    for rid in ("first", "second"):
        tokens, _, _, _ = run_tracking_blocks(
            engine, [RequestSpec(prompts[1], max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=rid)]
        )
        assert tokens[rid] == expected[1]
    assert engine.router.context.prefix is not None and engine.router.context.prefix.hit_tokens > 0


def test_two_requests_share_a_small_pool(mistral):
    """Two long windowed generations side by side in a pool too small to hold both whole."""
    path, prompts, expected = mistral
    whole = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    engine = make_engine(path, "self:1", k=2, k_max=2, block_size=BLOCK, num_blocks=whole + 4, max_context=128)
    specs = [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    tokens, most_target, _, _ = run_tracking_blocks(engine, specs)
    assert [tokens["0"], tokens["1"]] == expected
    assert most_target < whole


def test_mixed_local_and_global_layers_keep_every_block(tmp_path):
    """Gemma 2 alternates sliding and global layers: the global ones see every key, nothing is freed."""
    path = write_family(tmp_path / "gemma2", "gemma2", seed=3)
    engine = make_engine(str(path), "none", k=0, block_size=BLOCK, max_context=128)
    assert engine.router.context.target_pool.window == 0
    prompt = tuple(range(3, 3 + PROMPT))
    _, most_target, _, most_freed = run_tracking_blocks(
        engine, [RequestSpec(prompt, max_tokens=24, stop_at_eos=False, request_id="g")]
    )
    assert most_freed == 0 and most_target == -(-(PROMPT + 24 - 1) // BLOCK)


@pytest.mark.slow
@pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
def test_triton_kernels_over_released_blocks(mistral, monkeypatch):
    """The paged-attention kernel with released entries in the tables (block 0 in their place, the
    released blocks reused by the other request): still transformers' tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("VERIFYPD_ATTENTION", "triton")
    path, prompts, expected = mistral
    engine = make_engine(path, "self:1", k=2, k_max=2, block_size=BLOCK, max_context=128)
    assert engine.models.target_model.attention == "triton"
    n = 20
    specs = [RequestSpec(p, max_tokens=n, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    tokens, _, _, most_freed = run_tracking_blocks(engine, specs)
    assert [tokens["0"], tokens["1"]] == [e[:n] for e in expected] and most_freed > 0
