"""Per-request state machine of the speculative loop. Torch-free.

Token layout of a running sequence (n = len(all_ids) - 1):

    all_ids = prompt + output;   all_ids[n] is the *pending* token: committed, KV not yet written
    target KV holds positions [0, target_computed); target_computed == n while decoding
    draft  KV holds positions [0, draft_computed);  draft_computed <= n (it may lag, e.g. after
        plain-decoding steps or when all k drafts were accepted; the draft lane catches up by
        feeding all_ids[draft_computed : n + 1] in its first step)

Prefill computes KV for `all_ids[:prefill_target]` where prefill_target is the prompt length for a
fresh request (its last chunk samples the first token), or n after a preemption-by-recompute
(the pending token already exists, so nothing is sampled).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from verifypd.domain.requests import FinishReason, RequestSpec, RequestStats


@dataclass
class HeldDraft:
    """Drafts a pipelined (pdv) step made for a request and the next step verifies: proposals for
    positions start_pos + 1 .. start_pos + len(tokens), made when the pending token was at start_pos.
    The draft lane wrote draft KV up to start_pos + len(tokens) - 1; `draft_computed` is only moved
    when they are verified (as in a lock-step step), so dropping them (preemption, schedule change)
    needs no rollback. `tokens` and `probs` are opaque lane values (see DraftOutput); `tokens` may be
    empty (a pool-less lane proposed nothing): the next step then verifies with k = 0."""

    start_pos: int
    tokens: Any
    probs: Any
    typical: bool  # the draft call caught up on <= 2 tokens (a cost sample worth keeping)
    requested_k: int = 0  # the k asked of the draft lane (a pool-less lane may propose fewer)
    # Made right after the verify call before this step, from its verdict on the device
    # (steps.draft_after), not by a pipelined group: the next plan's other requests join at k = 0.
    predrafted: bool = False


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    PREFILLING = "prefilling"  # some prompt chunks done; holds blocks
    DECODING = "decoding"  # speculative loop; holds blocks
    FINISHED = "finished"  # blocks returned


@dataclass
class Sequence:
    spec: RequestSpec
    request_id: str
    arrival_order: int
    stats: RequestStats
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    target_blocks: list[int] = field(default_factory=list)
    draft_blocks: list[int] = field(default_factory=list)
    target_computed: int = 0
    draft_computed: int = 0
    finish_reason: FinishReason | None = None
    # Per-token acceptance estimate for the draft-length controller (draft_length.request_alpha);
    # None until anything is observed. draft_rejections counts verify steps that rejected a draft.
    alpha_estimate: float | None = None
    draft_rejections: int = 0
    # How often the draft lane proposes anything when asked (prompt lookup proposes nothing without
    # an n-gram match; a model draft always does): steps asked, steps with a proposal, the estimate
    # (draft_length.request_rate), None until the engine has one.
    drafts_asked: int = 0
    drafts_proposed: int = 0
    proposal_rate: float | None = None
    last_k: int = 0
    # The scheduler has decided this request's k once (its first decode step: the one chance of an
    # opening probe, KDecision._opening_probes).
    opened: bool = False
    # pdv pipelining (see Scheduler._plan_pipelined): the group (0 / 1) this request decodes in,
    # None until it first decodes; drafts held between the step that made them and the next one.
    group: int | None = None
    held_draft: HeldDraft | None = None
    # Prefix caching (router.prefix_cache): content keys of all_ids' full blocks computed so far, and
    # how many leading blocks of each table are keyed (registered, or taken from the cache).
    block_keys: list[bytes] = field(default_factory=list)
    keyed_target: int = 0
    keyed_draft: int = 0
    # Sliding windows (BlockManager.release_before): how many leading entries of each table are FREED.
    target_freed: int = 0
    draft_freed: int = 0

    @property
    def all_ids(self) -> list[int]:
        return list(self.spec.prompt_ids) + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] (0 <= start <= end) without building all_ids: a decode step reads one or
        two tokens of a context that grows to thousands, per request, every step."""
        p = len(self.spec.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        return list(self.spec.prompt_ids[start:end]) + (self.output_ids[: end - p] if end > p else [])

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Positions whose KV prefill must compute before decoding can start."""
        return len(self.spec.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def samples_after_prefill(self) -> bool:
        return not self.output_ids

    @property
    def pending_pos(self) -> int:
        return self.num_tokens - 1

    @property
    def remaining_tokens(self) -> int:
        return self.spec.max_tokens - len(self.output_ids)

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then first come first served."""
        return (-self.spec.priority, self.arrival_order)

    def reset_for_recompute(self) -> None:
        """Forget all KV (blocks already freed by the caller); generated tokens are kept."""
        self.status = SeqStatus.WAITING
        self.target_computed = 0
        self.draft_computed = 0
        self.group = None
        self.held_draft = None
        self.keyed_target = self.keyed_draft = 0  # (block_keys stay: the tokens did not change)
        self.target_freed = self.draft_freed = 0
        self.stats.preemptions += 1


def held_after(seq: Sequence) -> bool:
    """Does `seq` hold drafts made right after its last verify call (steps.draft_after)?"""
    return seq.held_draft is not None and seq.held_draft.predrafted
