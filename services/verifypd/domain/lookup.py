"""Prompt lookup beside a feature draft (`--draft eagle+ngram:`): what the router and the proposer share.

The router (floor 3) asks a `PromptLookup` for proposals before a step's draft call; the proposer
(verifypd.spec_decode.lookup_mix.LookupMix, floor 5) reads each request's tokens through
`TokenContext`. Neither imports the other: both speak these types. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TokenContext(Protocol):
    """A request's tokens so far (prompt and output, through the pending token)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    def ids(self, start: int, end: int) -> list[int]: ...


class LookupWork(Protocol):
    """A request that drafts this step: its tokens and how many drafts it may take (k)."""

    @property
    def seq(self) -> TokenContext: ...

    @property
    def k(self) -> int: ...


class PromptLookup(Protocol):
    """Proposals from the request's own context where it repeats; the others draft with the head."""

    proposed: int  # steps of a request that took lookup's proposal (telemetry)

    def take(self, work: Sequence[LookupWork]) -> dict[str, list[int]]: ...

    def settle(self, request_id: str, took_lookup: bool, k: int, accepted: int, verified: Sequence[int]) -> None:
        """A verify step of a request `take` saw: whether it verified lookup's proposal, its drafts
        (k), how many were accepted and the tokens it verified (accepted + 1)."""

    def may_skip(self) -> bool:
        """May the next step verify the head's drafts without consulting lookup (a verify call
        launched before the verdict lookup would need)? Counted as skipped when yes."""

    def forget(self, request_id: str) -> None: ...
