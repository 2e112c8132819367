"""Paged-KV bookkeeping for one pool: which blocks are free, which a sequence holds. Torch-free.

`check_fits` refuses up front a request that could never fit the context or the pools.

Invariant (checked by `check()` in tests): every block id in [0, num_blocks) is either on the
free list or owned by exactly one sequence table, never both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from verifypd.domain.requests import InvalidRequest, RequestSpec


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, name: str = "pool"):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"{name}: num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.name = name
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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
            block = self._free.popleft()
            self._owned.add(block)
            table.append(block)
        return True

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Returns blocks past what `num_tokens` positions need (after a rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _release(self, block: int) -> None:
        if block not in self._owned:
            raise RuntimeError(f"{self.name}: block {block} freed twice or never allocated")
        self._owned.remove(block)
        self._free.append(block)

    def check(self, tables: list[list[int]]) -> None:
        """Asserts the ownership invariant against the tables sequences hold."""
        held = [b for t in tables for b in t]
        if len(held) != len(set(held)):
            raise AssertionError(f"{self.name}: a block is held by two sequences")
        if set(held) != self._owned:
            raise AssertionError(f"{self.name}: owned set {len(self._owned)} != held {len(held)}")
        if len(self._free) + len(self._owned) != self.num_blocks or set(self._free) & self._owned:
            raise AssertionError(f"{self.name}: free list and owned set overlap or leak")


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
