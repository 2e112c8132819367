"""A step's plan: what the scheduler hands the step strategies. Torch-free.

`StepPlan` holds this step's prefill chunks (`PrefillChunk`) and decoding requests (`DecodeWork`,
each with its k), the requests preempted or out of room, and pdv's drafting group (`draft_ahead`).
The scheduler (router.scheduler) builds it; the step context and the strategies (router.steps) run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verifypd.router.sequence import Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int  # exclusive
    sample_first: bool  # last chunk of a fresh prompt: sample the first output token
    # Also write this chunk's draft KV (docs/engine.md "Draft prefill only when drafting"): False
    # while the request is not expected to draft; its draft KV then lags and its first draft call
    # catches up. Always True without lazy_draft_prefill (and meaningless with a pool-less draft).
    with_draft: bool = True


@dataclass
class DecodeWork:
    seq: Sequence
    k: int
    held: bool = False  # verify the drafts held from the previous (pipelined) step; draft nothing now
    probe: bool = False  # drafts PROBE_K although the batch's k is 0 (see ProbeSchedule)
    lookup: bool = False  # its drafts this step are prompt lookup's, not the head's (spec_decode.lookup_mix)


@dataclass
class StepPlan:
    prefill: list[PrefillChunk]
    decode: list[DecodeWork]
    preempted: list[Sequence]
    out_of_room: list[Sequence]  # alone in a full pool: the router ends them with LENGTH
    # pdv pipelined steps: requests that draft now and verify next step (disjoint from `decode`,
    # which then holds only requests verifying held drafts or plain-decoding with k = 0).
    draft_ahead: list[DecodeWork] = field(default_factory=list)
    pipelined: bool = False

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode
