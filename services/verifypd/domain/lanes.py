"""The one lane interface the router talks to, whatever the transport. Torch-free.

A lane is a batch executor over KV it is told about: it keeps no request state. Work items carry
`KvHandle`s by value; the router owns allocation. `draft_probs` is opaque to the router: an
in-process draft lane returns a device tensor that the in-process verify lane consumes as is; the
gRPC transport serializes it (dense or top-k sparse). It is None for greedy requests, and always
None from a draft lane whose proposals are deterministic (prompt lookup): q is then the one-hot of
the proposal, which the verify lane builds itself.

Pool-less draft lanes (prompt lookup, `none`) announce no pool (`LaneInfo.pools == ()`): the router
then allocates no draft blocks, prefill items carry `draft_kv=None` (prefill computes no draft
KV), draft items carry `draft_kv=None`, and such a lane may propose fewer than k tokens (even none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

from verifypd.domain.requests import RequestOutput, SamplingParams, TokenLogprob
from verifypd.domain.sampling_controls import ControlContext


@dataclass(frozen=True)
class PoolInfo:
    """What the router needs to know about a KV pool to allocate in it."""

    pool_id: str
    generation: int
    role: str  # "target" | "draft"
    num_layers: int
    num_blocks: int
    block_size: int
    # > 0: every layer of the pool's model attends only keys > p - window from a query at p
    # (Mistral-style), so the router releases the blocks behind the window; 0: some layer sees the
    # whole context (or the lane did not say), every block of a sequence is kept.
    window: int = 0


@dataclass(frozen=True)
class KvHandle:
    """A request's KV in one pool. Positions [0, seq_len) are written; [0, committed_len) verified."""

    pool_id: str
    generation: int
    block_ids: tuple[int, ...]
    seq_len: int
    committed_len: int


@dataclass(frozen=True)
class LaneInfo:
    lane: str
    pools: tuple[PoolInfo, ...]
    vocab_size: int
    max_context: int
    target_model: str = ""
    draft_model: str = ""
    # A feature draft (eagle:): it reads the target's hidden states through DraftItem.target_kv, and
    # its chain rows are speculative: after each verify the router re-feeds it from the token after
    # the verified pending one (draft_computed = n + 1), so it rewrites them from the target's features.
    reads_features: bool = False


@dataclass
class PrefillItem:
    request_id: str
    token_ids: list[int]  # prompt chunk
    start_pos: int  # position of token_ids[0]
    target_kv: KvHandle
    draft_kv: KvHandle | None  # None: the draft lane owns no pool
    sample_first: bool  # last chunk of a fresh prompt: sample the first token
    sampling: SamplingParams
    # Of a sample_first item with sampling controls (domain.sampling_controls); None: none.
    controls: ControlContext | None = None
    # Structured output: the first token's mask, int32 [1, ceil(V/32)] (numpy; domain.grammar's bit
    # layout), or None. Only with sample_first. Applied after the controls (sampling_controls step 5).
    token_mask: Any = None


@dataclass
class PrefillOutput:
    request_id: str
    first_token: int | None
    logprobs: list[TokenLogprob] | None = None  # [the first token's], when its sampling asks


@dataclass
class DraftItem:
    request_id: str
    input_tokens: list[int]  # committed tokens not yet in the draft pool (>= 1); for a pool-less
    # lane: not yet in its per-request history (the whole context once)
    start_pos: int  # position of input_tokens[0]
    draft_kv: KvHandle | None  # None: the draft lane owns no pool
    k: int  # drafts to propose, >= 1 (a pool-less lane may propose fewer)
    sampling: SamplingParams
    target_kv: KvHandle | None = None  # the target's blocks: where a feature draft reads features


@dataclass
class DraftOutput:
    request_id: str
    # A sequence of k ints. An in-process draft lane returns a lazy, device-backed sequence: the
    # router only takes its length and passes it on, the in-process verify lane reads the values
    # on the device (no host sync between draft and verify); iterating it copies them to the host.
    draft_tokens: Sequence[int]
    draft_probs: Any = None  # opaque; see module doc
    # Pool-less lanes only: the lane holds just [0, resync_from) of this request's tokens (it
    # restarted or evicted them), so the router resends from there; draft_tokens is then empty.
    resync_from: int | None = None


@dataclass
class VerifyItem:
    request_id: str
    pending_token: int
    start_pos: int  # position of pending_token
    draft_tokens: Sequence[int]  # as DraftOutput.draft_tokens
    target_kv: KvHandle
    sampling: SamplingParams
    draft_probs: Any = None
    controls: ControlContext | None = None  # as PrefillItem.controls
    # Structured output: int32 [len(draft_tokens) + 1, ceil(V/32)] (numpy; domain.grammar's bit
    # layout), row j masking the target's choice at start_pos + 1 + j; None: unconstrained.
    token_mask: Any = None


@dataclass(frozen=True)
class TokenFeed:
    """Pending tokens that are still on the device (overlapped scheduling, engine.overlap): item i's
    pending token is row `rows[i]` of the concatenation of `sources`, not its `pending_token` (a
    placeholder). The sources are device token vectors this lane's earlier started calls left: the
    previous verify call's `next_tokens`, then the first tokens of a prefill call started beside it
    (`PrefillLane.prefill_start(...).next_tokens`: a request prefilled there decodes in the very
    next step). Only lanes with `feeds_tokens` take one."""

    sources: tuple[Any, ...]  # opaque to the router: StartedCall.next_tokens of earlier calls
    rows: tuple[int, ...]


class HostTokens(tuple):
    """A TokenFeed source of pending tokens the host already has (a request whose first token came
    from a prefill lane in another process, committed after the step before this one was launched),
    after the previous verify call's `next_tokens`. Only lanes with `feeds_host_tokens` take one."""


@dataclass(frozen=True)
class VerdictFit:
    """Items laid out for the longest outcome of an earlier verify call still in flight (engine.spec_ahead):
    item i's pending token (a placeholder) sits at its start_pos only if row `rows[i]` of that call
    accepted all of its `ks[i]` drafts; the lane moves each row to the verdict on the device (its real
    pending token is the verdict's final token). Only lanes with `fits_verdict` take one, greedy only."""

    started: Any  # opaque to the router: the earlier call's StartedCall
    rows: tuple[int, ...]
    ks: tuple[int, ...]


@dataclass
class VerifyOutput:
    request_id: str
    accepted: int
    new_tokens: list[int] = field(default_factory=list)  # accepted drafts + one target token
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the item's sampling asks


class LaneError(RuntimeError):
    """A lane failed or became unreachable; in-flight requests end with UNAVAILABLE."""

    # Set by the router where a step failed after committing tokens: their chunks, for the caller to
    # stream before the error (read with getattr: a lane's own LaneError carries none).
    outputs: list[RequestOutput]


class PrefillLane(Protocol):
    def describe(self) -> LaneInfo: ...
    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]: ...
    def prefill_start(self, items: list[PrefillItem]) -> StartedCall: ...  # see the note below


class DraftLane(Protocol):
    def describe(self) -> LaneInfo: ...
    def draft(self, items: list[DraftItem]) -> list[DraftOutput]: ...


class DraftsAfterVerdict(DraftLane, Protocol):
    """A draft lane with `drafts_after_verdict` (a feature draft, engine.draft_after): it drafts right
    after a verify call (`started`), before that call's verdict reaches the host; item i's input ends
    in verify row `verify_rows[i]`'s `verify_ks[i]` + 1 tokens as placeholders, fitted on the device."""

    def draft_after(
        self, items: list[DraftItem], started: StartedCall, verify_rows: list[int], verify_ks: list[int]
    ) -> list[DraftOutput]: ...


class VerifyLane(Protocol):
    def describe(self) -> LaneInfo: ...
    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]: ...
    def verify_start(self, items: list[VerifyItem]) -> StartedCall: ...  # see the note below


class DeviceVerifyLane(VerifyLane, Protocol):
    """A verify lane with `feeds_tokens` (engine.overlap) or `fits_verdict` (engine.spec_ahead): its
    calls also take pending tokens left on the device (`feed`) or a layout fitted to an earlier call's
    verdict (`fit`)."""

    def verify_start(
        self, items: list[VerifyItem], feed: TokenFeed | None = None, fit: VerdictFit | None = None
    ) -> StartedCall: ...


def drafts_after_verdict(lane: DraftLane) -> TypeGuard[DraftsAfterVerdict]:
    """Does `lane` take `draft_after`?"""
    return bool(getattr(lane, "drafts_after_verdict", False))


def feeds_tokens(lane: VerifyLane) -> TypeGuard[DeviceVerifyLane]:
    """Does `lane` take `verify_start(items, feed=...)`?"""
    return bool(getattr(lane, "feeds_tokens", False))


def feeds_host_tokens(lane: VerifyLane) -> bool:
    """Does `lane` take a TokenFeed whose last source is HostTokens (the split topology's verify lane)?"""
    return bool(getattr(lane, "feeds_host_tokens", False))


def fits_verdict(lane: VerifyLane) -> TypeGuard[DeviceVerifyLane]:
    """Does `lane` take `verify_start(items, fit=...)` (greedy items only)?"""
    return bool(getattr(lane, "fits_verdict", False))


def plain_item(item: PrefillItem | VerifyItem) -> bool:
    """No sampling controls, logprobs or structured-output mask: the item's logits are chosen from as
    the model gives them, on the lanes' fast paths (the item-level `RequestSpec.plain`)."""
    return item.sampling.plain and item.token_mask is None


class StartedCall(Protocol):
    """A lane call whose device work is queued and whose results are not yet on the host
    (in-process lanes on CUDA: see `LocalVerifyLane.verify_start`)."""

    def ready(self) -> bool: ...  # the results can be had without waiting
    def result(self) -> list: ...  # waits for them (once)


class Finished:
    """A StartedCall that completed while it was started (CPU work, an empty call)."""

    def __init__(self, value: list):
        self.value = value

    def ready(self) -> bool:
        return True

    def result(self) -> list:
        return self.value


# `verify_start(items) -> StartedCall` and `prefill_start(items) -> StartedCall` start a call (the
# router uses them only where it overlaps calls: fakes that never overlap may leave them out), with
# `starts_async = True` where the started work runs on without the host (CUDA, or a call channel).
# The router then launches a step's prefill while the GPU still runs its verify call, so the
# prefill's host work (eager launches) overlaps the decode's GPU work (docs/engine.md "Prefill
# beside decode"). `verify(items)` is `verify_start(items).result()`.
#
# Overlapped plain decoding (engine.overlap): a verify lane with `feeds_tokens = True` takes
# `verify_start(items, feed=TokenFeed)`, and the StartedCall of a call whose items all have k = 0
# carries `next_tokens`: each row's chosen token left on the device (None otherwise), so the next
# step can be launched before this one's results reach the host. A prefill lane's started call
# carries `next_tokens` too where its items all sample a first token: those tokens, in item order.
