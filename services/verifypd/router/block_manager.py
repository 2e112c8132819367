"""Paged-KV bookkeeping for one pool: which blocks are free, which sequences hold them, and (with
prefix caching) which full blocks hold the KV of a known token prefix. Torch-free.

`check_fits` refuses up front a request that could never fit the context or the pools.

Blocks are reference counted: a block is held by the sequences whose tables list it (refcount >= 1)
or it is free (refcount 0, in `_free`). Prefix caching (docs/engine.md "Prefix caching") lets a FULL
block whose KV is final carry a content key (`register`, keys from `router.prefix_cache`); a
sequence whose prompt starts with the same blocks takes them (`acquire`) instead of computing
them. A freed keyed block keeps its key while it waits in `_free`, so a later request can still
take it; it loses the key only when it is handed out as a new block (`grow`: eviction).

`_free` is ordered: blocks are handed out from its front. A freed keyless block goes to the front
(nothing is lost by reusing it), a freed keyed one to the back, so the keyed blocks are evicted
least recently freed first, and only when no keyless block is free.

Sliding windows (docs/engine.md "Sliding-window KV"): in a pool whose model slides in EVERY layer
(`window` > 0: a query at p sees keys > p - window only), the leading blocks a sequence's queries can
no longer see are released (`release_before`); their table entries become `FREED`, so the table keeps
its indexing (entry i still covers positions [i * B, (i + 1) * B)). Lanes get NULL_BLOCK in their
place (`lane_table`): any valid block id does, since no query loads it (the Triton kernel starts at
the window, the reference path zeroes out-of-window keys). Freed entries are always a leading run.

Invariant (checked by `check()` in tests): every block id in [0, num_blocks) is either free or held
(refcount = the number of tables listing it), never both; a block held twice carries a key; the key
maps are each other's inverse. `FREED` entries count for nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from verifypd.domain.requests import InvalidRequest, RequestSpec

FREED = -1  # a table entry whose block was released out of the window (never sent to a lane)
NULL_BLOCK = 0  # what a lane gets for a FREED entry: a valid id that no query reads


def lane_table(table: list[int], freed: int) -> tuple[int, ...]:
    """`table` as lanes get it: its `freed` leading FREED entries as NULL_BLOCK."""
    if not freed:
        return tuple(table)
    return (NULL_BLOCK,) * freed + tuple(table[freed:])


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, name: str = "pool", caching: bool = False, window: int = 0):
        """`window` > 0: every layer of the pool's model sees only keys > p - window (PoolInfo.window)."""
        if num_blocks <= 0 or block_size <= 0 or window < 0:
            raise ValueError(f"{name}: num_blocks and block_size must be positive, window not negative")
        self.num_blocks = num_blocks
        self.window = window
        self.block_size = block_size
        self.name = name
        self.caching = caching  # register() keys blocks only when on
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: dict[int, int] = {}  # held blocks -> how many tables list them
        self._key_of: dict[int, bytes] = {}  # keyed block -> its content key
        self._block_of: dict[bytes, int] = {}  # content key -> the one block carrying it
        self.evictions = 0  # keyed free blocks handed out as new blocks (their key dropped)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a content key (held or free)."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks_needed(table, num_tokens) + reserve <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extends `table` in place so it holds `num_tokens` positions; all-or-nothing."""
        need = self.extra_blocks_needed(table, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:  # its KV is about to be overwritten: forget what it held
                del self._block_of[key]
                self.evictions += 1
            self._refs[block] = 1
            table.append(block)
        return True

    # -- prefix caching ------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks carrying keys[0], keys[1], ... up to the first key no block carries."""
        hits = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def key_of(self, block: int) -> bytes | None:
        """The content key `block` carries, or None."""
        return self._key_of.get(block)

    def can_admit(self, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Would an empty table take `hits` and grow to `num_tokens` positions, leaving `reserve`
        free? A hit no one holds sits in the free list: taking it uses a free block too."""
        new = max(0, self.blocks_for(num_tokens) - len(hits))
        return new + sum(block in self._free for block in hits) + reserve <= len(self._free)

    def acquire(self, table: list[int], hits: list[int]) -> None:
        """Appends the cached blocks `hits` (from `match`) to the empty `table`, sharing them."""
        if table:
            raise RuntimeError(f"{self.name}: cached blocks go at the start of an empty table")
        for block in hits:
            if block not in self._key_of:
                raise RuntimeError(f"{self.name}: block {block} carries no key (evicted since match?)")
            if block in self._free:  # cached, held by no one: now held
                del self._free[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
            table.append(block)

    def register(self, table: list[int], keys: Sequence[bytes], start: int, end: int) -> None:
        """Keys table[start:end] with keys[start:end]: the caller guarantees those blocks are full and
        their KV final (every position below the sequence's computed length, no speculative rows).
        A block already keyed keeps its key; a key some other block already carries (two requests
        computed the same prefix at once) stays with that block."""
        if not self.caching:
            return
        for i in range(start, end):
            block, key = table[i], keys[i]
            if block == FREED or block in self._key_of or key in self._block_of:
                continue
            self._key_of[block] = key
            self._block_of[key] = block

    # -- releasing -----------------------------------------------------------------------------
    def release_before(self, table: list[int], freed: int, first_query: int) -> int:
        """With a window: releases the leading blocks no query at a position >= `first_query` can see
        (every key of the block <= first_query - window) and returns how many leading entries of
        `table` are FREED now (`freed` before). Without one: `freed` unchanged. A released block that
        carries a content key stays cached (it goes back to the free list, key kept)."""
        if not self.window:
            return freed
        # Keys at positions >= first_query - window + 1 are still seen; block i ends at (i + 1) * B.
        dead = min(len(table), max(0, first_query - self.window + 1) // self.block_size)
        for i in range(freed, dead):
            self._release(table[i])
            table[i] = FREED
        return max(freed, dead)

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Returns blocks past what `num_tokens` positions need (after a rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            if block != FREED:
                self._release(block)

    def free(self, table: list[int]) -> None:
        """Releases the table from its end: of a request's keyed blocks, the later ones (the least
        likely to be shared) are evicted first."""
        while table:
            block = table.pop()
            if block != FREED:
                self._release(block)

    def _release(self, block: int) -> None:
        refs = self._refs.get(block)
        if refs is None:
            raise RuntimeError(f"{self.name}: block {block} freed twice or never allocated")
        if refs > 1:
            self._refs[block] = refs - 1
            return
        del self._refs[block]
        self._free[block] = None
        if block not in self._key_of:
            self._free.move_to_end(block, last=False)  # keyless: reuse it before any cached block

    def check(self, tables: list[list[int]]) -> None:
        """Asserts the ownership invariant against the tables sequences hold."""
        counts: dict[int, int] = {}
        for table in tables:
            for block in table:
                if block == FREED:
                    continue
                counts[block] = counts.get(block, 0) + 1
        if any(n > 1 and block not in self._key_of for block, n in counts.items()):
            raise AssertionError(f"{self.name}: a block without a content key is held by two sequences")
        if counts != self._refs:
            raise AssertionError(f"{self.name}: refcounts {len(self._refs)} blocks != held {len(counts)}")
        if len(self._free) + len(self._refs) != self.num_blocks or set(self._free) & set(self._refs):
            raise AssertionError(f"{self.name}: free list and held set overlap or leak")
        if len(self._key_of) != len(self._block_of) or any(self._block_of[k] != b for b, k in self._key_of.items()):
            raise AssertionError(f"{self.name}: content key maps disagree")


def check_fits(spec: RequestSpec, max_context: int, pools: Sequence[BlockManager]) -> None:
    """Rejects up front what can never complete; everything else waits or is preempted for room,
    never truncated (a request alone in a pool always fits, see the scheduler)."""
    need = len(spec.prompt_ids) + spec.max_tokens
    if need > max_context:
        raise InvalidRequest(
            f"prompt ({len(spec.prompt_ids)} tokens) + max_tokens ({spec.max_tokens}) = {need} "
            f"exceeds the model's context of {max_context} tokens; lower max_tokens to at most "
            f"{max_context - len(spec.prompt_ids)} or shorten the prompt"
        )
    for blocks in pools:
        # The last token's KV is never written: prompt + max_tokens - 1 positions at most.
        if blocks.blocks_for(need - 1) > blocks.num_blocks:
            raise InvalidRequest(
                f"prompt ({len(spec.prompt_ids)} tokens) + max_tokens ({spec.max_tokens}) can never "
                f"fit the {blocks.name} KV pool ({blocks.num_blocks} blocks of {blocks.block_size} "
                f"= {blocks.num_blocks * blocks.block_size} positions); lower max_tokens or "
                f"shorten the prompt"
            )
