"""Internal lane messages <-> the lane interface's dataclasses. Torch-free.

Draft probabilities are not decoded here: the gateway receives `DraftProbs` from the draft lane
and hands the very message to the verify lane (the router treats them as opaque), so the router
process never touches probability tensors. Only lane servers decode them (kv_transport.py).
"""

from __future__ import annotations

from verifypd.domain.lanes import (
    DraftItem,
    DraftOutput,
    KvHandle,
    LaneInfo,
    PoolInfo,
    PrefillItem,
    PrefillOutput,
    VerifyItem,
    VerifyOutput,
)
from verifypd.domain.requests import SamplingParams
from verifypd.v1 import generate_pb2, lanes_pb2

ROLE_TO_PB = {"target": lanes_pb2.POOL_ROLE_TARGET, "draft": lanes_pb2.POOL_ROLE_DRAFT}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}


def handle_to_pb(h: KvHandle) -> lanes_pb2.KvHandle:
    return lanes_pb2.KvHandle(
        pool_id=h.pool_id,
        generation=h.generation,
        block_ids=h.block_ids,
        seq_len=h.seq_len,
        committed_len=h.committed_len,
    )


def handle_from_pb(h: lanes_pb2.KvHandle) -> KvHandle:
    return KvHandle(h.pool_id, h.generation, tuple(h.block_ids), h.seq_len, h.committed_len)


def optional_handle_to_pb(h: KvHandle | None) -> lanes_pb2.KvHandle | None:
    """None (a pool-less draft lane) leaves the message field unset."""
    return None if h is None else handle_to_pb(h)


def draft_handle_from_pb(item) -> KvHandle | None:
    return handle_from_pb(item.draft_kv) if item.HasField("draft_kv") else None


def sampling_to_pb(s: SamplingParams) -> lanes_pb2.LaneSampling:
    return lanes_pb2.LaneSampling(
        params=generate_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k), seed=s.seed
    )


def sampling_from_pb(s: lanes_pb2.LaneSampling) -> SamplingParams:
    # float32 on the wire: the gateway's values already went through float32 (GenerateRequest),
    # and lanes use float32 tensors, so nothing changes on the way.
    return SamplingParams(
        temperature=s.params.temperature, top_p=s.params.top_p or 1.0, top_k=s.params.top_k, seed=s.seed
    )


def pool_info_from_pb(d: lanes_pb2.PoolDescriptor) -> PoolInfo:
    return PoolInfo(d.pool_id, d.generation, ROLE_FROM_PB[d.role], d.num_layers, d.num_blocks, d.block_size, d.window)


def lane_info_from_pb(info: lanes_pb2.LaneInfo) -> LaneInfo:
    return LaneInfo(
        lane=info.lane,
        pools=tuple(pool_info_from_pb(d) for d in info.pools),
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        target_model=info.target_model,
        draft_model=info.draft_model,
    )


# -- prefill ---------------------------------------------------------------------------------
def prefill_batch_to_pb(items: list[PrefillItem]) -> lanes_pb2.PrefillBatch:
    return lanes_pb2.PrefillBatch(
        items=[
            lanes_pb2.PrefillItem(
                request_id=i.request_id,
                token_ids=i.token_ids,
                start_pos=i.start_pos,
                target_kv=handle_to_pb(i.target_kv),
                draft_kv=optional_handle_to_pb(i.draft_kv),
                is_last_chunk=i.sample_first,
                sampling=sampling_to_pb(i.sampling),
            )
            for i in items
        ]
    )


def prefill_batch_from_pb(batch: lanes_pb2.PrefillBatch) -> list[PrefillItem]:
    return [
        PrefillItem(
            request_id=i.request_id,
            token_ids=list(i.token_ids),
            start_pos=i.start_pos,
            target_kv=handle_from_pb(i.target_kv),
            draft_kv=draft_handle_from_pb(i),
            sample_first=i.is_last_chunk,
            sampling=sampling_from_pb(i.sampling),
        )
        for i in batch.items
    ]


def prefill_outputs_to_pb(outputs: list[PrefillOutput], kv_bytes_copied: int) -> lanes_pb2.PrefillResult:
    result = lanes_pb2.PrefillResult(kv_bytes_copied=kv_bytes_copied)
    for o in outputs:
        out = result.outputs.add(request_id=o.request_id)
        if o.first_token is not None:
            out.first_token = o.first_token
    return result


def prefill_outputs_from_pb(result: lanes_pb2.PrefillResult) -> list[PrefillOutput]:
    return [PrefillOutput(o.request_id, o.first_token if o.HasField("first_token") else None) for o in result.outputs]


# -- draft -----------------------------------------------------------------------------------
def draft_batch_to_pb(items: list[DraftItem]) -> lanes_pb2.DraftBatch:
    return lanes_pb2.DraftBatch(
        items=[
            lanes_pb2.DraftItem(
                request_id=i.request_id,
                input_tokens=i.input_tokens,
                start_pos=i.start_pos,
                draft_kv=optional_handle_to_pb(i.draft_kv),
                k=i.k,
                sampling=sampling_to_pb(i.sampling),
            )
            for i in items
        ]
    )


def draft_batch_from_pb(batch: lanes_pb2.DraftBatch) -> list[DraftItem]:
    return [
        DraftItem(
            request_id=i.request_id,
            input_tokens=list(i.input_tokens),
            start_pos=i.start_pos,
            draft_kv=draft_handle_from_pb(i),
            k=i.k,
            sampling=sampling_from_pb(i.sampling),
        )
        for i in batch.items
    ]


def draft_outputs_to_pb(outputs: list[DraftOutput], encode_probs, top_ks: list[int]) -> lanes_pb2.DraftResult:
    """`encode_probs(probs, top_k)`: a draft lane's probability tensor -> `DraftProbs` (kv_transport.py)."""
    result = lanes_pb2.DraftResult()
    for out, top_k in zip(outputs, top_ks):
        msg = result.outputs.add(request_id=out.request_id, draft_tokens=out.draft_tokens)
        if out.resync_from is not None:
            msg.resync_from = out.resync_from
        if out.draft_probs is not None:
            msg.probs.CopyFrom(encode_probs(out.draft_probs, top_k))
    return result


def draft_outputs_from_pb(result: lanes_pb2.DraftResult) -> list[DraftOutput]:
    """`draft_probs` stays a `DraftProbs` message (or None for greedy): opaque to the router."""
    return [
        DraftOutput(
            o.request_id,
            list(o.draft_tokens),
            o.probs if o.probs.rows else None,
            o.resync_from if o.HasField("resync_from") else None,
        )
        for o in result.outputs
    ]


# -- verify ----------------------------------------------------------------------------------
def verify_batch_to_pb(items: list[VerifyItem], encode_probs=None) -> lanes_pb2.VerifyBatch:
    batch = lanes_pb2.VerifyBatch()
    for i in items:
        item = batch.items.add(
            request_id=i.request_id,
            pending_token=i.pending_token,
            start_pos=i.start_pos,
            draft_tokens=i.draft_tokens,
            target_kv=handle_to_pb(i.target_kv),
            sampling=sampling_to_pb(i.sampling),
        )
        if isinstance(i.draft_probs, lanes_pb2.DraftProbs):
            item.draft_probs.CopyFrom(i.draft_probs)
        elif i.draft_probs is not None:  # a tensor from an in-process draft lane
            item.draft_probs.CopyFrom(encode_probs(i.draft_probs, i.sampling.top_k))
    return batch


def verify_batch_from_pb(batch: lanes_pb2.VerifyBatch, decode_probs) -> list[VerifyItem]:
    return [
        VerifyItem(
            request_id=i.request_id,
            pending_token=i.pending_token,
            start_pos=i.start_pos,
            draft_tokens=list(i.draft_tokens),
            target_kv=handle_from_pb(i.target_kv),
            sampling=sampling_from_pb(i.sampling),
            draft_probs=decode_probs(i.draft_probs) if i.draft_probs.rows else None,
        )
        for i in batch.items
    ]


def verify_outputs_to_pb(outputs: list[VerifyOutput]) -> lanes_pb2.VerifyResult:
    return lanes_pb2.VerifyResult(
        outputs=[
            lanes_pb2.VerifyOutput(request_id=o.request_id, accepted=o.accepted, new_tokens=o.new_tokens)
            for o in outputs
        ]
    )


def verify_outputs_from_pb(result: lanes_pb2.VerifyResult) -> list[VerifyOutput]:
    return [VerifyOutput(o.request_id, o.accepted, list(o.new_tokens)) for o in result.outputs]
