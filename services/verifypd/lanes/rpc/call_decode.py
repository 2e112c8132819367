"""The call channel's compact messages, lane side: validate a `PackedBatch` against the lane's
limits, apply it to the connection's state and turn it into the lane interface's work items;
encode the lane's outputs as a `LaneReply`. Torch-free (numpy for the columns).

Checks match the unary path's (lane_validate.py) and name the field: `batch.k_u32[3]`,
`batch.target_blocks.added_u32`. Every check runs before any state changes, so a refused call
leaves nothing half-applied (and the lane closes the connection after an error anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verifypd.domain.lanes import (
    DraftItem,
    DraftOutput,
    KvHandle,
    PrefillItem,
    PrefillOutput,
    VerifyItem,
    VerifyOutput,
)
from verifypd.domain.requests import MAX_K, SamplingParams
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc.call_codec import NONE_U32, HandoffTokens, u32
from verifypd.lanes.rpc.call_pipeline import FedTokens
from verifypd.lanes.rpc.lane_convert import sampling_from_pb
from verifypd.v1 import lanes_pb2

MAX_HELD = 1 << 16  # requests one connection may hold
MAX_REQUEST_ID = 256  # characters


@dataclass
class HeldRequest:
    request_id: str
    sampling: SamplingParams


class ChannelState:
    """What one connection holds: its requests (by key) and their block tables (by role, key)."""

    def __init__(self) -> None:
        self.requests: dict[int, HeldRequest] = {}
        self.tables: dict[tuple[str, int], tuple[int, ...]] = {}
        self.handles: dict[tuple[str, int], KvHandle] = {}  # built once per table, not per call
        self.fed = FedTokens()  # verify: the last call's tokens left on the device (call_pipeline.py)

    def release(self, keys) -> None:
        for key in keys:
            self.requests.pop(key, None)
            for role in ("target", "draft"):
                self.tables.pop((role, key), None)
                self.handles.pop((role, key), None)

    def handle(self, pool, role: str, key: int) -> KvHandle:
        """The request's KvHandle in `pool`. Lanes read only its block ids: the channel carries no
        lengths, so seq_len and committed_len are 0 here."""
        table = self.tables[(role, key)]
        h = self.handles.get((role, key))
        if h is None or h.block_ids is not table:
            h = self.handles[(role, key)] = KvHandle(pool.pool_id, pool.generation, table, 0, 0)
        return h


def _column(batch, name: str, n: int, required: bool = True) -> np.ndarray:
    data = getattr(batch, name)
    if not required and not data:
        return np.zeros(n, dtype=np.int64)
    if len(data) != 4 * n:
        raise lv.LaneInvalid(f"batch.{name}: {len(data)} bytes, expected {4 * n} (uint32 per item)")
    return np.frombuffer(data, dtype="<u4").astype(np.int64)


def _flat(batch, name: str, counts: np.ndarray, field: str | None = None) -> np.ndarray:
    data = getattr(batch, name)
    need = int(counts.sum())
    if len(data) != 4 * need:
        raise lv.LaneInvalid(f"{field or 'batch.' + name}: {len(data)} bytes, expected {4 * need}")
    return np.frombuffer(data, dtype="<u4").astype(np.int64)


def _intros(state: ChannelState, batch) -> dict[int, HeldRequest]:
    new: dict[int, HeldRequest] = {}
    for n, intro in enumerate(batch.intros):
        f = f"batch.intros[{n}]"
        if intro.key in state.requests or intro.key in new:
            raise lv.LaneInvalid(f"{f}.key: {intro.key} is already held on this channel")
        if not 0 < len(intro.request_id) <= MAX_REQUEST_ID:
            raise lv.LaneInvalid(f"{f}.request_id: must be 1..{MAX_REQUEST_ID} characters")
        lv.check_sampling(f"{f}.sampling", intro.sampling)
        new[intro.key] = HeldRequest(intro.request_id, sampling_from_pb(intro.sampling))
    if len(state.requests) + len(new) > MAX_HELD:
        raise lv.LaneInvalid(f"batch.intros: more than {MAX_HELD} requests held on one channel; release some")
    return new


def _tables(
    state: ChannelState, field: str, delta, role: str, keys, ends: np.ndarray, limits: lv.LaneLimits
) -> list[tuple[int, ...]]:
    """The items' new tables in one pool; checks them like lane_validate checks a handle."""
    pool = limits.pools.get(role)
    if pool is None:
        raise lv.LaneInvalid(
            f"{field}: this lane holds no {role} pool (call ImportPools first)", lv.grpc.StatusCode.FAILED_PRECONDITION
        )
    if delta.pool_id != pool.pool_id or delta.generation != pool.generation:
        raise lv.LaneInvalid(
            f"{field}: pool {delta.pool_id!r} generation {delta.generation} is not this lane's "
            f"{role} pool ({pool.pool_id!r} generation {pool.generation}); a handle from before a "
            f"lane restart?",
            lv.grpc.StatusCode.FAILED_PRECONDITION,
        )
    n = len(keys)
    keep, counts = _column(delta, "keep_u32", n), _column(delta, "added_count_u32", n)
    added = _flat(delta, "added_u32", counts, f"{field}.added_u32")
    if added.size and int(added.max()) >= pool.num_blocks:
        raise lv.LaneInvalid(f"{field}.added_u32: block {int(added.max())} is outside the pool [0, {pool.num_blocks})")
    if ends.size and int(ends.max()) > limits.max_context:
        raise lv.LaneInvalid(
            f"{field}: positions up to {int(ends.max())} exceed the lane's context of {limits.max_context}"
        )
    held = [state.tables.get((role, key), ()) for key in keys]
    held_len = np.fromiter(map(len, held), dtype=np.int64, count=n)
    if (keep > held_len).any():
        i = int(np.argmax(keep > held_len))
        raise lv.LaneInvalid(f"{field}.keep_u32[{i}]: {int(keep[i])} kept, the channel holds {int(held_len[i])} blocks")
    lens = keep + counts
    bad = np.nonzero((lens * pool.block_size < ends) | (lens > pool.num_blocks))[0]
    if bad.size:
        i = int(bad[0])
        raise lv.LaneInvalid(
            f"{field}: item {i}: {int(lens[i])} blocks of {pool.block_size} cannot hold "
            f"{int(ends[i])} positions (pool of {pool.num_blocks} blocks)"
        )
    if not counts.any() and (keep == held_len).all():  # the usual decode step: no table changed
        return held
    tables, at, added_l = [], 0, added.tolist()
    for table, kept, count in zip(held, keep.tolist(), counts.tolist()):
        tables.append(table[:kept] + tuple(added_l[at : at + count]) if count or kept < len(table) else table)
        at += count
    return tables


def decode(
    method: int, batch, state: ChannelState, limits: lv.LaneLimits, handoff: tuple[int, int] | None = None
) -> list:
    """Validates and applies a PackedBatch; returns the work items. Raises LaneInvalid.
    `handoff`: (rows, cols) of the DraftHandoff buffer this lane writes or reads, if any."""
    n = len(batch.keys_u32) // 4
    if n > lv.MAX_ITEMS:
        raise lv.LaneInvalid(f"batch: {n} items in one call; at most {lv.MAX_ITEMS}")
    keys = _column(batch, "keys_u32", n).tolist()
    starts = _column(batch, "start_pos_u32", n)
    counts = _column(batch, "token_count_u32", n)
    rows = _handoff_rows(method, batch, n, counts, handoff)
    host_counts = counts if rows is None else np.where(rows == NONE_U32, counts, 0)
    tokens = _flat(batch, "tokens_u32", host_counts)
    new = _intros(state, batch)
    if n == 0:  # nothing to run (a keep-alive, or intros ahead of use)
        state.requests.update(new)
        return []
    held: list[HeldRequest] = []
    for k in keys:
        h = state.requests.get(k) or new.get(k)
        if h is None:
            raise lv.LaneInvalid(f"batch.keys_u32: key {k} is not held on this channel (no intro)")
        held.append(h)
    if tokens.size and limits.vocab_size and int(tokens.max()) >= limits.vocab_size:
        raise lv.LaneInvalid(
            f"batch.tokens_u32: token id {int(tokens.max())} is outside the vocabulary [0, {limits.vocab_size})"
        )
    ks = _column(batch, "k_u32", n, required=method == lanes_pb2.LANE_METHOD_DRAFT)
    if method != lanes_pb2.LANE_METHOD_VERIFY and n and int(counts.min()) < 1:
        raise lv.LaneInvalid(f"batch.token_count_u32[{int(np.argmin(counts))}]: need at least 1 token")
    if method == lanes_pb2.LANE_METHOD_DRAFT and n and not (ks.min() >= 1 and ks.max() <= MAX_K):
        bad = int(np.nonzero((ks < 1) | (ks > MAX_K))[0][0])
        raise lv.LaneInvalid(f"batch.k_u32[{bad}]: must be in [1, {MAX_K}], got {int(ks[bad])}")
    if method == lanes_pb2.LANE_METHOD_VERIFY and n and int(counts.max()) > MAX_K:
        raise lv.LaneInvalid(f"batch.token_count_u32[{int(np.argmax(counts))}]: at most {MAX_K} drafts")
    # Positions each item writes: prefill its chunk; draft inputs + k - 1 drafts; verify pending + drafts.
    ends = (
        starts
        + counts
        + (ks - 1 if method == lanes_pb2.LANE_METHOD_DRAFT else 0)
        + (1 if method == lanes_pb2.LANE_METHOD_VERIFY else 0)
    )
    if int(ends.sum() - starts.sum()) > lv.MAX_BATCH_TOKENS:
        raise lv.LaneInvalid(
            f"batch: {int(ends.sum() - starts.sum())} token positions in one call; at most {lv.MAX_BATCH_TOKENS}"
        )
    target = draft = None
    if method != lanes_pb2.LANE_METHOD_DRAFT:
        target = _tables(state, "batch.target_blocks", batch.target_blocks, "target", keys, ends, limits)
    if method != lanes_pb2.LANE_METHOD_VERIFY:
        if batch.HasField("draft_blocks"):
            draft = _tables(state, "batch.draft_blocks", batch.draft_blocks, "draft", keys, ends, limits)
        elif "draft" in limits.pools:
            raise lv.LaneInvalid("batch.draft_blocks: missing: this lane holds a draft pool")
    probs = _probs(batch, n, counts, limits) if method == lanes_pb2.LANE_METHOD_VERIFY else {}
    # Valid: apply the intros and tables.
    state.requests.update(new)
    for role, tables in (("target", target), ("draft", draft)):
        if tables is not None:
            state.tables.update({(role, k): t for k, t in zip(keys, tables)})
    if method == lanes_pb2.LANE_METHOD_DRAFT and batch.handoff_slot:
        if handoff is None or n > handoff[0] or int(ks.max()) > handoff[1]:
            raise lv.LaneInvalid(
                f"batch.handoff_slot: this lane's handoff buffer cannot take {n} items of up to {int(ks.max())} drafts"
                if handoff
                else "batch.handoff_slot: this lane has no handoff buffer (CUDA only)"
            )
        if not all(h.sampling.greedy for h in held):
            raise lv.LaneInvalid("batch.handoff_slot: only greedy requests hand drafts off (sampled ones need q)")
    bounds = np.concatenate(([0], np.cumsum(host_counts))).tolist()
    toks = tokens.tolist()
    starts_l, ks_l = starts.tolist(), ks.tolist()
    pending = _column(batch, "pending_u32", n, required=method == lanes_pb2.LANE_METHOD_VERIFY)
    items = _items(
        method, batch, state, keys, held, target, draft, starts_l, ks_l, toks, bounds, pending, probs, limits
    )
    if rows is not None:  # drafts that stayed on the draft lane's device
        for item, row, k in zip(items, rows.tolist(), counts.tolist()):
            if row != NONE_U32:
                item.draft_tokens = HandoffTokens(batch.handoff_slot, row, k)
    return items


def _handoff_rows(method: int, batch, n: int, counts: np.ndarray, handoff) -> np.ndarray | None:
    """Verify with a handoff slot: each item's row in it (NONE_U32: drafts in tokens_u32)."""
    if batch.handoff_slot not in (0, 1, 2):
        raise lv.LaneInvalid(f"batch.handoff_slot: must be 0, 1 or 2, got {batch.handoff_slot}")
    if method != lanes_pb2.LANE_METHOD_VERIFY or not batch.handoff_slot:
        return None
    if handoff is None:
        raise lv.LaneInvalid(
            "batch.handoff_slot: this lane opened no draft handoff buffer", lv.grpc.StatusCode.FAILED_PRECONDITION
        )
    rows = _column(batch, "draft_rows_u32", n)
    on_device = rows != NONE_U32
    if on_device.any() and (int(rows[on_device].max()) >= handoff[0] or int(counts[on_device].max()) > handoff[1]):
        raise lv.LaneInvalid(f"batch.draft_rows_u32: rows must be < {handoff[0]} and drafts <= {handoff[1]}")
    return rows


def _probs(batch, n: int, counts: np.ndarray, limits: lv.LaneLimits) -> dict[int, object]:
    rows = np.frombuffer(batch.probs_items_u32, dtype="<u4").tolist() if len(batch.probs_items_u32) % 4 == 0 else None
    if rows is None or len(rows) != len(batch.draft_probs) or any(r >= n for r in rows) or len(set(rows)) != len(rows):
        raise lv.LaneInvalid("batch.probs_items_u32: must list distinct item indices, one per draft_probs entry")
    for j, row in enumerate(rows):
        lv.check_probs(f"batch.draft_probs[{j}]", batch.draft_probs[j], int(counts[row]), limits.vocab_size)
    return dict(zip(rows, batch.draft_probs))


def _items(method, batch, state, keys, held, target, draft, starts, ks, toks, bounds, pending, probs, limits) -> list:
    def handle(tables, role, i, _end):
        return None if tables is None else state.handle(limits.pools[role], role, keys[i])

    if method == lanes_pb2.LANE_METHOD_PREFILL:
        last = _column(batch, "last_chunk_u32", len(held)).tolist()
        return [
            PrefillItem(
                h.request_id,
                toks[bounds[i] : bounds[i + 1]],
                starts[i],
                handle(target, "target", i, starts[i]),
                handle(draft, "draft", i, starts[i]),
                bool(last[i]),
                h.sampling,
            )
            for i, h in enumerate(held)
        ]
    if method == lanes_pb2.LANE_METHOD_DRAFT:
        return [
            DraftItem(
                h.request_id,
                toks[bounds[i] : bounds[i + 1]],
                starts[i],
                handle(draft, "draft", i, starts[i]),
                ks[i],
                h.sampling,
            )
            for i, h in enumerate(held)
        ]
    if pending.size and limits.vocab_size and int(pending.max()) >= limits.vocab_size:
        raise lv.LaneInvalid(f"batch.pending_u32: token id {int(pending.max())} is outside the vocabulary")
    pend = pending.tolist()
    return [
        VerifyItem(
            h.request_id,
            pend[i],
            starts[i],
            toks[bounds[i] : bounds[i + 1]],
            handle(target, "target", i, starts[i]),
            h.sampling,
            probs.get(i),
        )
        for i, h in enumerate(held)
    ]


# -- replies ---------------------------------------------------------------------------------
def prefill_reply(outputs: list[PrefillOutput], kv_bytes_copied: int) -> lanes_pb2.LaneReply:
    return lanes_pb2.LaneReply(
        tokens_u32=u32(NONE_U32 if o.first_token is None else o.first_token for o in outputs),
        kv_bytes_copied=kv_bytes_copied,
    )


def draft_reply(outputs: list[DraftOutput], encode_probs, top_ks: list[int]) -> lanes_pb2.LaneReply:
    tokens: list[int] = []
    for o in outputs:
        tokens.extend(o.draft_tokens)
    with_probs = [n for n, o in enumerate(outputs) if o.draft_probs is not None]
    return lanes_pb2.LaneReply(
        count_u32=u32(len(o.draft_tokens) for o in outputs),
        tokens_u32=u32(tokens),
        resync_from_u32=u32(NONE_U32 if o.resync_from is None else o.resync_from for o in outputs),
        probs_items_u32=u32(with_probs),
        draft_probs=[encode_probs(outputs[n].draft_probs, top_ks[n]) for n in with_probs],
    )


def verify_reply(outputs: list[VerifyOutput]) -> lanes_pb2.LaneReply:
    tokens: list[int] = []
    for o in outputs:
        tokens.extend(o.new_tokens)
    return lanes_pb2.LaneReply(count_u32=u32(o.accepted for o in outputs), tokens_u32=u32(tokens))
