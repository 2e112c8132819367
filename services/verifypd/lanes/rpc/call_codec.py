"""The call channel's compact messages (lanes.proto `LaneCall` / `LaneReply`), router side.
Torch- and numpy-free: the gateway of `split` runs this on every lane call.

Columns are packed uint32 arrays built with the stdlib `array` (one C loop per column, no
protobuf sub-message per item). `ChannelMirror` is the router's copy of what one connection's
lane holds: request keys and block tables, so that a call only carries what changed — a new
request's id and sampling once, then per step the blocks appended to its tables (usually none).
The lane side is `call_decode.py`; both sides drop all state when the connection ends.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

from verifypd.domain.lanes import (
    DraftItem,
    DraftOutput,
    KvHandle,
    PrefillItem,
    PrefillOutput,
    VerifyItem,
    VerifyOutput,
)
from verifypd.lanes.rpc.lane_convert import sampling_to_pb
from verifypd.v1 import lanes_pb2

NONE_U32 = 0xFFFFFFFF  # "no value" in a uint32 column (no first token, no resync)
assert array("I").itemsize == 4 and sys.byteorder == "little", "call channel columns are uint32 LE"


def u32(values: Iterable[int]) -> bytes:
    return array("I", values).tobytes()


def from_u32(data: bytes, n: int | None = None) -> array:
    """The uint32 column in `data`; with n, it must hold exactly n values (ValueError)."""
    out = array("I")
    out.frombytes(data[: len(data) - len(data) % 4])
    if n is not None and len(out) != n:
        raise ValueError(f"a column of {len(out)} values for {n} items")
    return out


class HandoffTokens(Sequence[int]):
    """`k` proposals that sit in row `row` of DraftHandoff slot `slot` on the device: the router
    takes only their number; the verify lane reads them there. Never readable on the host."""

    def __init__(self, slot: int, row: int, k: int):
        self.slot, self.row, self.k = slot, row, k

    def __len__(self) -> int:
        return self.k

    def __getitem__(self, index):
        raise TypeError("handed-off draft tokens live on the draft lane's device; only the verify lane reads them")


class ChannelMirror:
    """What the lane at the other end of one connection holds (keys, tables); reset on reconnect."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}  # request id -> channel key
        self.tables: dict[tuple[str, int], tuple[int, ...]] = {}  # (role, key) -> held block table
        self.released: list[int] = []  # keys to drop with the next call
        self._next_key = 0

    def key(self, request_id: str, sampling, intros) -> int:
        key = self.keys.get(request_id)
        if key is None:
            key = self.keys[request_id] = self._next_key
            self._next_key = (self._next_key + 1) & 0x7FFFFFFF
            intros.append(lanes_pb2.RequestIntro(key=key, request_id=request_id, sampling=sampling_to_pb(sampling)))
        return key

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            key = self.keys.pop(rid, None)
            if key is not None:
                self.tables.pop(("target", key), None)
                self.tables.pop(("draft", key), None)
                self.released.append(key)

    def delta(self, role: str, keys: list[int], handles: list[KvHandle]) -> lanes_pb2.BlockTableDelta:
        keep, counts, added = array("I"), array("I"), array("I")
        for key, handle in zip(keys, handles):
            new = handle.block_ids
            held = self.tables.get((role, key), ())
            kept = len(held)
            if new[:kept] != held:  # the table was rebuilt (preemption): keep the common prefix
                kept = next((i for i, (a, b) in enumerate(zip(new, held)) if a != b), min(len(new), kept))
            keep.append(kept)
            counts.append(len(new) - kept)
            added.extend(new[kept:])
            self.tables[(role, key)] = new
        first = handles[0]
        return lanes_pb2.BlockTableDelta(
            pool_id=first.pool_id,
            generation=first.generation,
            keep_u32=keep.tobytes(),
            added_count_u32=counts.tobytes(),
            added_u32=added.tobytes(),
        )

    def batch(self, items, tokens_of) -> tuple[lanes_pb2.PackedBatch, list[int]]:
        """The columns every method shares; returns (batch, keys)."""
        intros: list = []
        keys = [self.key(i.request_id, i.sampling, intros) for i in items]
        counts, tokens = array("I"), array("I")
        for item in items:
            toks = tokens_of(item)
            counts.append(len(toks))
            tokens.extend(toks)
        batch = lanes_pb2.PackedBatch(
            intros=intros,
            released=self.released,
            keys_u32=u32(keys),
            start_pos_u32=u32(i.start_pos for i in items),
            token_count_u32=counts.tobytes(),
            tokens_u32=tokens.tobytes(),
        )
        self.released = []
        return batch, keys


# -- router -> lane --------------------------------------------------------------------------
def encode_prefill(mirror: ChannelMirror, items: list[PrefillItem]) -> lanes_pb2.PackedBatch:
    batch, keys = mirror.batch(items, lambda i: i.token_ids)
    batch.last_chunk_u32 = u32(int(i.sample_first) for i in items)
    batch.target_blocks.CopyFrom(mirror.delta("target", keys, [i.target_kv for i in items]))
    if items[0].draft_kv is not None:
        batch.draft_blocks.CopyFrom(mirror.delta("draft", keys, _every([i.draft_kv for i in items], "draft_kv")))
    return batch


def encode_draft(mirror: ChannelMirror, items: list[DraftItem], handoff_slot: int = 0) -> lanes_pb2.PackedBatch:
    batch, keys = mirror.batch(items, lambda i: i.input_tokens)
    batch.handoff_slot = handoff_slot
    batch.k_u32 = u32(i.k for i in items)
    if items[0].draft_kv is not None:
        batch.draft_blocks.CopyFrom(mirror.delta("draft", keys, _every([i.draft_kv for i in items], "draft_kv")))
    return batch


def _every(handles: list[KvHandle | None], field: str) -> list[KvHandle]:
    """The items' handles in one pool: a call carries one for every item or for none."""
    present = [h for h in handles if h is not None]
    if len(present) != len(handles):
        raise ValueError(f"{field}: {len(handles) - len(present)} of {len(handles)} items have none (all or none)")
    return present


def encode_verify(mirror: ChannelMirror, items: list[VerifyItem], encode_probs) -> lanes_pb2.PackedBatch:
    """`encode_probs(tensor, top_k)` serializes probabilities of an in-process draft lane (only when
    an in-process draft lane feeds a remote verify lane); `DraftProbs` messages pass as they are."""
    handed = [i.draft_tokens if isinstance(i.draft_tokens, HandoffTokens) else None for i in items]
    batch, keys = mirror.batch(items, lambda i: () if isinstance(i.draft_tokens, HandoffTokens) else i.draft_tokens)
    batch.pending_u32 = u32(i.pending_token for i in items)
    if any(h is not None for h in handed):
        slots = {h.slot for h in handed if h is not None}
        if len(slots) != 1:
            raise ValueError(f"one verify call reads one handoff slot; got drafts from slots {sorted(slots)}")
        batch.handoff_slot = slots.pop()
        batch.draft_rows_u32 = u32(NONE_U32 if h is None else h.row for h in handed)
        batch.token_count_u32 = u32(len(i.draft_tokens) for i in items)
    batch.target_blocks.CopyFrom(mirror.delta("target", keys, [i.target_kv for i in items]))
    with_probs = [n for n, i in enumerate(items) if i.draft_probs is not None]
    if with_probs:
        batch.probs_items_u32 = u32(with_probs)
        for n in with_probs:
            probs = items[n].draft_probs
            batch.draft_probs.append(
                probs if isinstance(probs, lanes_pb2.DraftProbs) else encode_probs(probs, items[n].sampling.top_k)
            )
    return batch


# -- lane -> router --------------------------------------------------------------------------
def decode_prefill(items: list[PrefillItem], reply: lanes_pb2.LaneReply) -> list[PrefillOutput]:
    firsts = from_u32(reply.tokens_u32, len(items))
    return [PrefillOutput(i.request_id, None if t == NONE_U32 else t) for i, t in zip(items, firsts)]


def decode_draft(items: list[DraftItem], reply: lanes_pb2.LaneReply, handoff_slot: int = 0) -> list[DraftOutput]:
    if handoff_slot:  # the proposals stayed on the device: counts only
        return [
            DraftOutput(item.request_id, HandoffTokens(handoff_slot, n, c))
            for n, (item, c) in enumerate(zip(items, from_u32(reply.count_u32, len(items))))
        ]
    counts, tokens = from_u32(reply.count_u32, len(items)), from_u32(reply.tokens_u32)
    resync = from_u32(reply.resync_from_u32, len(items))
    probs = dict(zip(from_u32(reply.probs_items_u32), reply.draft_probs))
    outputs, at = [], 0
    for n, item in enumerate(items):
        c = counts[n]
        outputs.append(
            DraftOutput(
                item.request_id,
                tokens[at : at + c].tolist(),
                probs.get(n),
                None if resync[n] == NONE_U32 else resync[n],
            )
        )
        at += c
    return outputs


def decode_verify(items: list[VerifyItem], reply: lanes_pb2.LaneReply) -> list[VerifyOutput]:
    accepted, tokens = from_u32(reply.count_u32, len(items)), from_u32(reply.tokens_u32)
    if len(tokens) != sum(accepted) + len(items):
        raise ValueError(f"{len(tokens)} new tokens for {len(items)} items that accepted {sum(accepted)}")
    outputs, at = [], 0
    for item, m in zip(items, accepted):
        outputs.append(VerifyOutput(item.request_id, m, tokens[at : at + m + 1].tolist()))
        at += m + 1
    return outputs
