"""Automatic prefix caching (router.prefix_cache, router.block_manager): block keys, reference
counts, LRU eviction, cache-aware admission, and through the engine: cached and uncached runs give
the same tokens (greedy and seeded, every kind of draft, preemption, chunked prefill), a block is
never shared once its content differs, and no speculative position is ever keyed."""

from __future__ import annotations

import random

import pytest
from engine_cases import write_head
from engine_helpers import VOCAB, make_engine

from verifypd.domain.requests import RequestSpec, RequestStats, SamplingParams
from verifypd.router.block_manager import BlockManager
from verifypd.router.prefix_cache import PrefixCache, chain_key, chain_keys, root_key
from verifypd.router.sequence import Sequence

ROOT = root_key("m")


def _keys(tokens, size=4, root=ROOT):
    keys, parent = [], root
    for i in range(len(tokens) // size):
        parent = chain_key(parent, list(tokens[i * size : (i + 1) * size]))
        keys.append(parent)
    return keys


# -- the block manager --------------------------------------------------------------------------
def test_keys_chain_the_whole_prefix():
    a = _keys([5, 6, 7, 8, 9, 10, 11, 12])
    b = _keys([4, 6, 7, 8, 9, 10, 11, 12])  # same second block, other first block
    assert a[0] != b[0] and a[1] != b[1]  # the second block's key depends on the first block too
    assert _keys([5, 6, 7, 8], root=root_key("other model"))[0] != a[0]  # the root is part of it


def test_many_keys_at_once_are_the_chain_of_single_keys():
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB) for _ in range(41)] + [2**40]  # an id past 32 bits
    for size in (1, 4, 16):
        assert chain_keys(ROOT, tokens, size) == _keys(tokens, size)  # partial last block: no key
    assert chain_keys(ROOT, tokens[:3], 4) == []
    links: dict[bytes, bytes] = {}  # the memo: filled by the first call, read by the second
    assert chain_keys(ROOT, tokens, 4, links) == chain_keys(ROOT, tokens, 4, links) == _keys(tokens, 4)
    assert len(links) == 10
    other = tokens[:4] + [7, 7, 7, 7] + tokens[8:]  # block 1 differs: every key from it on differs
    assert chain_keys(ROOT, other, 4, links) == _keys(other, 4) and len(links) == 19
    # A sequence's keys cover its prompt and output, computed in several calls as blocks fill.
    spec = RequestSpec(tuple(tokens[:30]), max_tokens=20)
    seq = Sequence(spec=spec, request_id="r", arrival_order=0, stats=RequestStats(), output_ids=tokens[30:])
    cache = PrefixCache(BlockManager(num_blocks=8, block_size=4, caching=True), None, ROOT)
    assert cache.keys(seq, 3) == _keys(tokens, 4)[:3]
    assert cache.keys(seq, 10) == _keys(tokens, 4)  # the rest, across the prompt's end (30)
    assert cache.max_links == 32  # 4 per block of the pool; past that the memo is emptied
    cache.links.update({bytes([n]): b"" for n in range(33 - len(cache.links))})
    seq.block_keys.clear()
    assert cache.keys(seq, 2) == _keys(tokens, 4)[:2] and len(cache.links) == 2


def test_shared_blocks_are_refcounted_and_evicted_last_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=4, caching=True)
    a: list[int] = []
    assert bm.grow(a, 10)  # 3 blocks, the last one partly filled
    keys = _keys(list(range(3, 11)))  # the 2 full blocks
    bm.register(a, keys, 0, 2)
    assert bm.num_cached == 2
    hits = bm.match(keys + [b"x" * 16])
    assert hits == a[:2]
    b: list[int] = []
    assert bm.can_admit(hits, 9, reserve=2)  # 1 new block + 2 reserve of 3 free
    assert not bm.can_admit(hits, 9, reserve=3)
    bm.acquire(b, hits)
    assert bm.grow(b, 9) and b[:2] == a[:2] and b[2] != a[2]
    bm.check([a, b])
    bm.free(a)  # the shared blocks stay held by b
    bm.check([b])
    assert bm.num_free == 3 and bm.match(keys) == b[:2]
    bm.free(b)
    bm.check([])
    assert bm.num_free == 6 and bm.num_cached == 2  # freed, still cached
    # Cached blocks held by no one count as free, but take a free block when taken again.
    assert bm.can_admit(hits, 24)  # 4 new + the 2 cached ones: 6 of 6 free
    assert not bm.can_admit(hits, 28)  # 5 new + 2
    # Keyless blocks are handed out before any cached one; then the cached ones, later blocks first.
    c: list[int] = []
    assert bm.grow(c, 16)
    assert set(c).isdisjoint(hits) and bm.num_cached == 2
    assert bm.grow(c, 20)
    assert c[-1] == hits[1] and bm.match(keys) == hits[:1] and bm.evictions == 1
    bm.check([c])
    with pytest.raises(RuntimeError):
        bm.acquire([], [hits[1]])  # evicted: no longer carries its key


def test_register_keeps_the_first_block_of_a_key_and_check_catches_sharing_without_a_key():
    bm = BlockManager(num_blocks=4, block_size=2, caching=True)
    a, b = [], []
    bm.grow(a, 2)
    bm.grow(b, 2)
    keys = _keys([3, 4], size=2)
    bm.register(a, keys, 0, 1)
    bm.register(b, keys, 0, 1)  # computed the same prefix at once: a keeps the key
    assert bm.match(keys) == a
    bm.check([a, b])
    with pytest.raises(AssertionError):
        bm.check([a, b, b])  # b's block is keyless: two tables may not hold it
    off = BlockManager(num_blocks=4, block_size=2)  # caching off: register keys nothing
    t: list[int] = []
    off.grow(t, 2)
    off.register(t, keys, 0, 1)
    assert off.num_cached == 0 and off.match(keys) == []


# -- through the engine --------------------------------------------------------------------------
def _shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """A 21-token base; prompts that extend it, diverge from it inside a block, or repeat it."""
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(21)]
    return [
        base + [5, 6, 7],
        base + [8, 9],  # same first 20 (5 blocks of 4), then diverges inside block 5
        base[:14] + [40, 41, 42, 43, 44],  # diverges inside block 3 (positions 12..15)
        base,  # all of it cached but the last position
        [base[0] + 1] + base[1:],  # same tokens after the first: nothing may be shared
        base[:20],  # 5 full blocks, all cached: the last is computed again (its logits sample)
    ]


def _one_by_one(engine, prompts, max_tokens=12, sampling=None):
    """Each prompt alone (so later ones find the earlier ones cached): tokens, cached_tokens, keyed
    blocks never past what is computed (checked after every step)."""
    out = []
    router = engine.router
    for i, p in enumerate(prompts):
        s = sampling(i) if sampling else SamplingParams()
        rid = router.add_request(RequestSpec(tuple(p), max_tokens=max_tokens, stop_at_eos=False, sampling=s))
        tokens, cached = [], None
        while router.has_work():
            for o in router.step():
                tokens += o.token_ids
                cached = o.stats.cached_tokens
            _check_keyed_is_final(router)
        out.append((rid, tokens, cached))
    router.target_blocks.check([])
    return [t for _, t, _ in out], [c for _, _, c in out]


def _check_keyed_is_final(router):
    """No block is keyed past a sequence's computed KV (its partly filled and speculative blocks)."""
    size = router.target_blocks.block_size
    for seq in router.sequences():
        assert seq.keyed_target * size <= seq.target_computed
        assert seq.keyed_draft * size <= seq.draft_computed or router.context.prefix.draft is None
        for i, block in enumerate(seq.target_blocks):
            key = router.target_blocks.key_of(block)
            if i >= seq.keyed_target:
                assert key is None, f"block {i} of {seq.request_id} keyed before its KV was final"
            else:  # its own key, or none (another block computed at the same time carries it)
                assert key in (None, seq.block_keys[i])
        # every key is its block's tokens' (never a key over tokens not yet appended)
        prefix = router.context.prefix
        assert prefix is None or seq.block_keys == chain_keys(prefix.root, seq.all_ids, size)[: len(seq.block_keys)]
    router.target_blocks.check([s.target_blocks for s in router.sequences()])


@pytest.mark.parametrize("draft", ["model", "ngram", "self:1", "eagle"])
def test_cached_and_uncached_give_the_same_tokens(tiny_models, tmp_path, draft):
    spec = {"model": tiny_models[1], "ngram": "ngram", "self:1": "self:1"}.get(draft)
    if draft == "eagle":
        spec = write_head(tiny_models, tmp_path / "head")
    prompts = _shared_prefix_prompts()
    plain, _ = _one_by_one(make_engine(tiny_models[0], spec, k=3, prefix_cache=False), prompts)
    engine = make_engine(tiny_models[0], spec, k=3)
    cached, counts = _one_by_one(engine, prompts)
    assert cached == plain
    assert counts == [0, 20, 12, 20, 0, 16]
    prefix = engine.router.context.prefix
    assert prefix.hit_tokens == 68 and prefix.queried_tokens == sum(len(p) for p in prompts)
    if draft in ("model", "self:1"):  # a model draft's pool is cached too; an EAGLE head's is not
        assert prefix.draft is not None and engine.router.draft_blocks.num_cached > 0
    else:
        assert prefix.draft is None


def test_seeded_sampling_and_multi_turn_reuse_output_blocks(tiny_models):
    """Turn 2 resends turn 1 (prompt and answer): the answer's blocks, written by verify steps with
    rejected drafts, are reused, and sampled tokens (seeded) are the uncached run's."""
    rng = random.Random(4)
    first = [rng.randrange(3, VOCAB) for _ in range(10)]

    def turns(engine):
        s = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
        a, _ = _one_by_one(engine, [first], max_tokens=17, sampling=lambda i: s)
        convo = first + a[0] + [7, 8, 9]
        b, cached = _one_by_one(engine, [convo], max_tokens=10, sampling=lambda i: s)
        return a + b, cached

    plain, _ = turns(make_engine(*tiny_models, k=3, prefix_cache=False))
    engine = make_engine(*tiny_models, k=3)
    tokens, cached = turns(engine)
    assert tokens == plain
    # 10 + 17 answer tokens: the KV of positions 0..25 (26 = the last answer token, never fed) is
    # computed, 6 full blocks of 4.
    assert cached == [24]
    assert engine.router.context.costs.acceptance.observations > 0


def test_chunked_prefill_and_preemption_keep_working(tiny_models):
    """A tight pool (preemption by recompute, eviction of cached blocks) and a small prefill budget
    (chunks): the same tokens as an uncached roomy run, every block accounted for."""
    from verifypd.domain.config import RuntimeConfig

    rng = random.Random(9)
    base = [rng.randrange(3, VOCAB) for _ in range(17)]
    specs = [
        RequestSpec(
            tuple(base + [rng.randrange(3, VOCAB) for _ in range(i % 5)]),
            max_tokens=18,
            stop_at_eos=False,
            request_id=f"r{i}",
        )
        for i in range(8)
    ]
    roomy = make_engine(*tiny_models, k=3, num_blocks=512, prefix_cache=False)
    expected = {rid: c.token_ids for rid, c in roomy.generate(specs).items()}

    config = RuntimeConfig(k_min=0, k_max=8, k_initial=3, adaptive=False, prefill_token_budget=8)
    tight = make_engine(*tiny_models, k=3, num_blocks=20)
    tight.router.config = config
    router = tight.router
    for spec in specs:
        router.add_request(spec)
    got: dict[str, list[int]] = {}
    preemptions = 0
    while router.has_work():
        for out in router.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            preemptions += out.finished and out.stats.preemptions
        _check_keyed_is_final(router)
        router.draft_blocks.check([s.draft_blocks for s in router.sequences()])
    assert got == expected
    # The cache served prompts, the pool was too small to keep every cached block, and requests were
    # preempted (recomputed, partly from the cache).
    assert router.context.prefix.hit_tokens > 0 and router.target_blocks.evictions > 0 and preemptions > 0
    assert router.target_blocks.num_used == 0 and router.draft_blocks.num_used == 0
