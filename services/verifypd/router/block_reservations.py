"""The KV blocks the scheduler reserves for its requests' positions, in the target pool and the draft
pool (when the draft lane owns one), each reservation all or nothing. Torch-free.

`BlockReservations` answers "do these positions fit, and reserve them": a decode step's k + 1
target / k draft positions, a prefill chunk's (after the prefix the cache holds), the next position of
a step planned ahead, a speculative step's longest outcome; and returns a request's blocks. Choosing
who gets them (k falling to 0, preemption, admission order) is the scheduler's (router.scheduler).
"""

from __future__ import annotations

from verifypd.router.block_manager import BlockManager
from verifypd.router.prefix_cache import PrefixCache
from verifypd.router.sequence import Sequence
from verifypd.router.step_plan import PrefillChunk


class BlockReservations:
    def __init__(self, target: BlockManager, draft: BlockManager | None, prefix: PrefixCache | None = None):
        """`prefix`: prefix caching (router.prefix_cache): a waiting request's first chunk starts after
        its cached prefix (`admit_cached`); its draft KV may then start shorter and catch up in the
        draft call."""
        self.target = target
        # None: a pool-less draft lane needs no draft blocks (`draft` grows and frees none)
        self.draft_blocks = draft
        self.draft: BlockManager | NoPool = draft or NoPool()
        self.prefix = prefix

    def reserve(self, seq: Sequence, n: int, k: int, with_draft: bool = True) -> bool:
        """Blocks for n + k + 1 target and (`with_draft`) n + k draft positions, all or nothing."""
        draft = self.draft if with_draft else NoPool()
        if len(seq.target_blocks) * self.target.block_size >= n + k + 1 and (  # already held: most steps
            not with_draft or self.draft_blocks is None or len(seq.draft_blocks) * self.draft_blocks.block_size >= n + k
        ):
            return True
        if not (self.target.can_grow(seq.target_blocks, n + k + 1) and draft.can_grow(seq.draft_blocks, n + k)):
            return False
        self.target.grow(seq.target_blocks, n + k + 1)
        draft.grow(seq.draft_blocks, n + k)
        return True

    def free(self, seq: Sequence) -> None:
        """Returns `seq`'s blocks (finished, cancelled, preempted)."""
        self.release_tables(seq.target_blocks, seq.draft_blocks)

    def release_tables(self, target: list[int], draft: list[int]) -> None:
        """Returns blocks held back from a finished request (steps.overlapped) once nothing queued writes them."""
        self.target.free(target)
        self.draft.free(draft)

    # -- prefill chunks ----------------------------------------------------------------------
    def prefill_chunk(self, seq: Sequence, budget: int, reserve: int) -> PrefillChunk | None:
        """`seq`'s next prefill chunk within `budget` tokens, its blocks reserved with `reserve` free
        blocks left over (None: it does not fit)."""
        if self.prefix is not None and not seq.target_blocks:
            return self.admit_cached(seq, budget, reserve, self.prefix)
        start = seq.target_computed
        end = min(seq.prefill_target, start + budget)
        if not (
            self.target.can_grow(seq.target_blocks, end, reserve)
            and self.draft.can_grow(seq.draft_blocks, end, reserve)
        ):
            return None
        self.target.grow(seq.target_blocks, end)
        self.draft.grow(seq.draft_blocks, end)
        last = end == seq.prefill_target
        return PrefillChunk(
            seq, start, end, sample_first=last and seq.samples_after_prefill, with_draft=seq.draft_computed == start
        )

    def admit_cached(self, seq: Sequence, budget: int, reserve: int, prefix: PrefixCache) -> PrefillChunk | None:
        """A waiting request's first chunk, after the prefix the cache holds: the cached blocks count
        as already there (only those no one holds take free blocks), all or nothing."""
        hits, draft_hits = prefix.lookup(seq)
        start = len(hits) * self.target.block_size
        end = min(seq.prefill_target, start + budget)
        if not (self.target.can_admit(hits, end, reserve) and self.draft.can_admit(draft_hits, end, reserve)):
            return None
        self.target.acquire(seq.target_blocks, hits)
        self.target.grow(seq.target_blocks, end)
        self.draft.acquire(seq.draft_blocks, draft_hits)
        self.draft.grow(seq.draft_blocks, end)
        seq.target_computed = start
        if self.draft_blocks is not None:  # a pool-less lane is fed the whole history in its first call
            seq.draft_computed = len(draft_hits) * self.draft_blocks.block_size
        prefix.admitted(seq, hits, draft_hits)
        last = end == seq.prefill_target
        return PrefillChunk(
            seq, start, end, sample_first=last and seq.samples_after_prefill, with_draft=seq.draft_computed == start
        )

    # -- steps planned ahead (the scheduler's, steps.speculate_ahead) ---------------------------
    def fits_ahead(self, seqs: list[Sequence]) -> bool:
        """Would the scheduler's decode plan reserve the next step of `seqs` (each at the k of the drafts
        it holds, or 0) without preempting anyone? (steps.speculate_ahead plans ahead only then.)"""
        ks = [len(s.held_draft.tokens) if s.held_draft is not None else 0 for s in seqs]
        target = sum(
            self.target.extra_blocks_needed(s.target_blocks, s.pending_pos + k + 1)
            for s, k in zip(seqs, ks, strict=False)
        )
        if target > self.target.num_free:
            return False
        draft = self.draft_blocks
        return (
            draft is None
            or sum(draft.extra_blocks_needed(s.draft_blocks, s.pending_pos + k) for s, k in zip(seqs, ks, strict=False))
            <= draft.num_free
        )

    def reserve_target(self, rows: list[tuple[Sequence, int]]) -> bool:
        """Target blocks for `rows` (request, positions it may write), all or none, without preemption:
        a verify call launched before the verdict of the one before it may write its longest outcome's
        positions (steps.speculate_ahead). False (nothing reserved) if they are not free."""
        need = sum(self.target.extra_blocks_needed(s.target_blocks, n) for s, n in rows)
        if need > self.target.num_free:
            return False
        for seq, n in rows:
            self.target.grow(seq.target_blocks, n)
        return True

    def next_position_fits(self, seqs: list[Sequence], with_draft: bool = True) -> bool:
        """The token in flight of each of `seqs` sits at pending_pos + 1 and is verified there: its KV
        needs pending_pos + 2 target positions (a draft holds one fewer; `with_draft` False: not
        counted). Are those blocks free?"""
        need = sum(self.target.extra_blocks_needed(s.target_blocks, s.pending_pos + 2) for s in seqs)
        draft = self.draft_blocks if with_draft else None
        return need <= self.target.num_free and (
            draft is None
            or sum(draft.extra_blocks_needed(s.draft_blocks, s.pending_pos + 1) for s in seqs) <= draft.num_free
        )

    def reserve_next_position(self, seqs: list[Sequence], with_draft: bool = True) -> None:
        """Reserves what `next_position_fits` counted free (as reserve(seq, n + 1, 0))."""
        for seq in seqs:
            reserved = self.reserve(seq, seq.pending_pos + 1, 0, with_draft)
            assert reserved, "blocks counted free were not"


class NoPool:
    """Stands in for the draft BlockManager when the draft lane owns no pool: always room, no blocks."""

    def can_grow(self, blocks: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return True

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        return True

    def can_admit(self, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return True

    def acquire(self, blocks: list[int], hits: list[int]) -> None:
        pass

    def free(self, blocks: list[int]) -> None:
        pass
