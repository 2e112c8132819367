"""Automatic prefix caching: content keys of full KV blocks, lookup at admission, registration as
KV becomes final. Torch-free. docs/engine.md "Prefix caching".

A block's key chains its parent's key with its own token ids:

    key[0] = H(root, tokens[0:B]);  key[i] = H(key[i-1], tokens[i*B:(i+1)*B])    (H = BLAKE2b-128)

so equal keys mean equal token prefixes, hence equal KV. `root` hashes everything else the KV
depends on: the target model's name (a LoRA adapter or another model would go here too); sampling
parameters change no KV. Only a FULL block whose every position is below the sequence's computed
length is keyed (`register`): a partly filled last block is never shared, and positions written by
draft tokens the verify lane has not accepted yet are at or past `target_computed`, so they are
never keyed. Rejected drafts only ever wrote past `target_computed`: keyed blocks are never
rewritten, and rollback needs nothing here.

Pools: the target pool always (the feature pool of an EAGLE head lives in its slots, so cached
target blocks carry valid features too). A model draft's pool (`self:N`, a draft model) is keyed
the same way, by its own block manager: its KV at a position depends on the same tokens. An EAGLE
head's pool is not keyed (its row at p depends on token p + 1, past the block): on a hit the head
catches up over the cached prefix in its first draft call, from the cached target features.
"""

from __future__ import annotations

import hashlib
from array import array

from verifypd.router.block_manager import BlockManager
from verifypd.router.sequence import Sequence

KEY_BYTES = 16


def root_key(namespace: str) -> bytes:
    """The parent of every first block's key: what besides the tokens decides the KV."""
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES, person=b"verifypd-prefix").digest()


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of one block of `tokens` after the block keyed `parent` (the definition; `chain_keys`
    computes the same keys for many blocks at once)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())  # int64: every token id fits, one byte layout per host
    return h.digest()


_EMPTY = hashlib.blake2b(digest_size=KEY_BYTES)  # copied per block: cheaper than a new hasher


def chain_keys(
    parent: bytes, tokens: list[int], block_size: int, links: dict[bytes, bytes] | None = None
) -> list[bytes]:
    """chain_key over the consecutive full blocks of `tokens` (len(tokens) // block_size keys), the
    first after `parent`. The same keys as a loop of chain_key, at about half the host time: one
    int64 conversion for all blocks, a copied hasher per block (a cache hit on a 1,500-token prompt
    hashes ~94 blocks before its prefill can start: ~0.14 ms of the plan step in a chain_key loop).

    `links`: a memo of chain_key, parent key + the block's int64 bytes -> key, read and filled here. A
    dict compares its keys byte for byte, so a hit is exactly the hash it saves (~0.4 of its time
    per block: a prompt whose prefix an earlier request hashed costs about a third as much)."""
    data = array("q", tokens).tobytes()
    width = block_size * 8  # bytes per block (int64 ids, as chain_key)
    keys = []
    known = links.get if links is not None else None
    for at in range(0, len(tokens) // block_size * width, width):
        link = parent + data[at : at + width]
        key = known(link) if known is not None else None
        if key is None:
            h = _EMPTY.copy()
            h.update(link)
            key = h.digest()
            if links is not None:
                links[link] = key
        parent = key
        keys.append(key)
    return keys


# PrefixCache.links holds at most this many entries (~250 bytes each), and as many as 4 per block of
# the target pool: past that it is emptied (a memo of a pure function: only time is lost).
MAX_LINKS = 1 << 16


class PrefixCache:
    """The router's prefix cache over the target pool and, for a model draft, the draft pool (its
    BlockManager built with caching on; otherwise None). Counts for telemetry: tokens looked up at
    admission and tokens served from the cache (`hit_rate`)."""

    def __init__(self, target: BlockManager, draft: BlockManager | None, root: bytes):
        if draft is not None and draft.block_size != target.block_size:
            raise ValueError("prefix caching of a draft pool needs the target's block size")
        self.target, self.draft, self.root = target, draft, root
        self.links: dict[bytes, bytes] = {}  # chain_keys' memo
        self.max_links = min(MAX_LINKS, 4 * target.num_blocks)
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def block_size(self) -> int:
        return self.target.block_size

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.block_keys extended to at least `num_blocks` full blocks of all_ids (kept on the sequence:
        its tokens never change, so each key is computed once, also across preemptions)."""
        keys, size = seq.block_keys, self.block_size
        have = len(keys)
        if have < num_blocks:
            if num_blocks * size > seq.num_tokens:  # a key over fewer tokens than its block holds
                raise ValueError(f"{seq.request_id}: block {num_blocks - 1} is not full of tokens yet")
            if len(self.links) > self.max_links:
                self.links.clear()
            tokens = seq.ids(have * size, num_blocks * size)
            keys += chain_keys(keys[-1] if keys else self.root, tokens, size, self.links)
        return keys

    def lookup(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks a waiting `seq` may start from: (target blocks, draft blocks), the draft's
        never longer than the target's. At least one position of the prefill is always left to
        compute (the last one's logits sample the first token)."""
        usable = max(0, seq.prefill_target - 1) // self.block_size
        if usable == 0:
            return [], []
        keys = self.keys(seq, usable)[:usable]
        hits = self.target.match(keys)
        draft_hits = self.draft.match(keys[: len(hits)]) if self.draft is not None else []
        return hits, draft_hits

    def admitted(self, seq: Sequence, hits: list[int], draft_hits: list[int]) -> None:
        """`seq` was admitted starting from the cached blocks `hits` / `draft_hits` (counted for the
        hit rate; the first admission's count is the request's `cached_tokens`)."""
        cached = len(hits) * self.block_size
        self.queried_tokens += seq.prefill_target
        self.hit_tokens += cached
        if not seq.output_ids:  # a recompute after preemption is not the user's prompt
            seq.stats.cached_tokens = cached
        seq.keyed_target, seq.keyed_draft = len(hits), len(draft_hits)

    def register(self, seq: Sequence) -> None:
        """Keys the blocks of `seq` that became full and final since the last call (after a prefill
        chunk or a verify step was committed into target_computed / draft_computed)."""
        size, known = self.block_size, seq.num_tokens
        # Computed KV can run ahead of the tokens: a verify call's accepted drafts are computed before
        # they are appended, and a stop among them truncates what is. Only blocks of known tokens.
        full = min(seq.target_computed, known) // size
        if full > seq.keyed_target:
            self.target.register(seq.target_blocks, self.keys(seq, full), seq.keyed_target, full)
            seq.keyed_target = full
        if self.draft is not None:
            full = min(seq.draft_computed, known) // size
            if full > seq.keyed_draft:
                self.draft.register(seq.draft_blocks, self.keys(seq, full), seq.keyed_draft, full)
                seq.keyed_draft = full

    @property
    def hit_rate(self) -> float | None:
        return None if self.queried_tokens == 0 else self.hit_tokens / self.queried_tokens
