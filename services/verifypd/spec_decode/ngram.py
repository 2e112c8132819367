"""Prompt-lookup (n-gram) drafting: a `DraftLane` with no model, no device and no KV pool. Torch-free.

It proposes the tokens that followed the most recent earlier occurrence of the request's last n
tokens in its own context (prompt + output), trying n = max_n down to min_n (longest match first).
When nothing matches it proposes nothing and the request plain-decodes that step.

Why it is lossless with sampling: the verify lane's coupled acceptance (`verifypd.model.sampler`)
emits the target's own seeded choice at every position and keeps a proposal only when it equals
that choice, whatever proposed it; no draft probabilities are needed (`draft_probs` is None), so
only token ids cross the wire and this lane never needs torch.

Context without resending it every step: the lane keeps a per-request token history that plays
the role a draft model's KV pool plays for a model draft lane, under the same invariant (see
`verifypd.router.sequence`): the router believes the lane holds positions [0, draft_computed);
each `DraftItem` carries `all_ids[start_pos : n + 1]` with `start_pos = draft_computed`, the lane
truncates its history to `start_pos` (that is the rollback of rejected proposals) and appends the
new tokens, then appends its own proposals at n+1.. exactly as a model lane writes draft KV there.
So after the prompt has been sent once, each step sends 1-2 tokens. The history is a cache: when a
request's history is missing or shorter than `start_pos` (lane restarted, entry evicted) the lane
proposes nothing and answers `resync_from`, and the router resends from there next step.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from verifypd.domain.drafts import DEFAULT_MAX_N, DEFAULT_MIN_N, DraftSpec
from verifypd.domain.lanes import DraftItem, DraftOutput, LaneInfo

TOKEN_BYTES = array("i").itemsize  # 4: every token id fits a C int
# Bound of the histories kept (all requests together); least recently drafted requests go first.
DEFAULT_CAPACITY_TOKENS = 1 << 20


def propose(context: list[int], k: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> list[int]:
    """Up to k tokens continuing `context` by prompt lookup (stateless reference of `TokenHistory.propose`).

    For n = max_n .. min_n: find the most recent earlier start i (i + n < len(context)) with
    context[i:i+n] == context[-n:]; propose context[i+n], context[i+n+1], ... The copy may run past
    the end of the context into the proposal itself (an overlapping copy, as in LZ77), so a
    periodic tail like "a b a b" keeps proposing "a b a b ..." up to k tokens.
    """
    history = TokenHistory(min_n, max_n)
    history.extend(context)
    return history.propose(k)


class TokenHistory:
    """One request's tokens, mirrored as int32 bytes so a lookup is one C-speed `bytes.rfind`.

    No n-gram index: extending (every step, and a probe's catch-up over a whole prompt) is an
    append, and a lookup is one backward byte search for the shortest suffix n-gram. An index of
    every n-gram made the catch-up ~1 us per token (a tuple and a dict entry per n), the largest
    host cost prompt lookup added to a step at batch 16 while it hardly drafted; the search is a few
    microseconds over a few thousand tokens, paid only when a draft is asked for."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._bytes = bytearray()  # self.tokens as native int32, TOKEN_BYTES each

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        self.tokens.extend(new)
        self._bytes += array("i", new).tobytes()

    def truncate(self, length: int) -> None:
        """Drops positions >= length."""
        del self.tokens[length:]
        del self._bytes[length * TOKEN_BYTES :]

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        size = len(toks)
        src = self._match_end(size)
        if src < 0:
            return []
        out: list[int] = []
        for j in range(k):
            pos = src + j
            out.append(toks[pos] if pos < size else out[pos - size])
        return out

    def _match_end(self, size: int) -> int:
        """Where the most recent earlier occurrence of the longest matching suffix n-gram (min_n..max_n
        tokens, ending before the last token) ends; -1: none. One byte search for the min_n-token
        suffix: every occurrence of a longer suffix ends in one of its occurrences, so each is
        extended backwards, most recent first, until one reaches max_n (a scan per n tried cost
        twice the index's time per drafting step at 300 tokens)."""
        lo, hi = self.min_n, min(self.max_n, size - 1)
        if hi < lo:
            return -1
        toks, buf = self.tokens, self._bytes
        pattern = bytes(buf[(size - lo) * TOKEN_BYTES :])
        end = (size - 1) * TOKEN_BYTES  # an occurrence must end before the last token
        best, best_n = -1, 0
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                return best
            end = at + len(pattern) - 1
            if at % TOKEN_BYTES:  # byte matches straddling two tokens are not token matches
                continue
            i = at // TOKEN_BYTES
            n = lo
            while n < hi and i - (n - lo) > 0 and toks[i - (n - lo) - 1] == toks[size - n - 1]:
                n += 1
            if n > best_n:
                best, best_n = i + lo, n
                if n == hi:
                    return best


class HistoryCache:
    """Requests' TokenHistory objects, bounded in tokens (all requests together): the least recently
    used go first (the one just put stays). `take` removes a history; `put` returns it."""

    def __init__(self, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS):
        self.capacity_tokens = capacity_tokens
        self._histories: OrderedDict[str, TokenHistory] = OrderedDict()  # least recently used first
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._histories)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._histories

    def clear(self) -> None:
        self._histories.clear()
        self.tokens = 0

    def take(self, request_id: str) -> TokenHistory | None:
        history = self._histories.pop(request_id, None)
        if history is not None:
            self.tokens -= len(history)
        return history

    def put(self, request_id: str, history: TokenHistory) -> None:
        self._histories[request_id] = history
        self.tokens += len(history)
        while self.tokens > self.capacity_tokens and len(self._histories) > 1:
            rid, oldest = next(iter(self._histories.items()))
            if rid == request_id:
                break
            del self._histories[rid]
            self.tokens -= len(oldest)


class NgramDraftLane:
    """The prompt-lookup draft lane (in-process; the split draft lane server wraps the same class)."""

    def __init__(
        self,
        info: LaneInfo,
        min_n: int = DEFAULT_MIN_N,
        max_n: int = DEFAULT_MAX_N,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    ):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"ngram needs 1 <= MIN <= MAX, got MIN={min_n} MAX={max_n}")
        if info.pools:
            raise ValueError("the n-gram draft lane owns no KV pool; announce pools=()")
        self.info, self.min_n, self.max_n = info, min_n, max_n
        self._histories = HistoryCache(capacity_tokens)

    def describe(self) -> LaneInfo:
        return self.info

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        return [self._draft_one(item) for item in items]

    def _draft_one(self, item: DraftItem) -> DraftOutput:
        if item.k < 1:
            raise ValueError(f"draft items need k >= 1; request {item.request_id} has k={item.k}")
        history = self._histories.take(item.request_id)
        if history is None:
            if item.start_pos > 0:  # we never saw (or evicted) its beginning: ask for all of it
                return DraftOutput(item.request_id, [], None, resync_from=0)
            history = TokenHistory(self.min_n, self.max_n)
        elif len(history) < item.start_pos:
            self._histories.put(item.request_id, history)
            return DraftOutput(item.request_id, [], None, resync_from=len(history))
        history.truncate(item.start_pos)
        history.extend(item.input_tokens)
        proposal = history.propose(item.k)
        history.extend(proposal)  # positions n+1.., like draft KV; the next call truncates rejects
        self._histories.put(item.request_id, history)
        return DraftOutput(item.request_id, proposal, None)

    def forget(self, request_id: str) -> None:
        """Drops a finished request's history now (optional: eviction reclaims it anyway)."""
        self._histories.take(request_id)

    @property
    def cached_requests(self) -> int:
        return len(self._histories)


class NoDraftLane:
    """`--draft none` / `--no-speculation`: loads nothing, owns no pool, proposes nothing."""

    def __init__(self, info: LaneInfo):
        self.info = info

    def describe(self) -> LaneInfo:
        return self.info

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        return [DraftOutput(i.request_id, [], None) for i in items]


def poolless_draft_lane(spec: DraftSpec, info: LaneInfo):
    """The lane of a draft kind that needs no model (None for model kinds)."""
    if spec.kind == "ngram":
        return NgramDraftLane(info, spec.min_n, spec.max_n)
    if spec.kind == "none":
        return NoDraftLane(info)
    return None
