"""The gateway's hand-made stream messages and its per-stream mailbox (gateway CPU per
token): `response_wire.ResponseEncoder` gives exactly the protobuf runtime's bytes for every field
combination, and `engine_client.StreamBox` hands a consumer that fell behind all pending chunks as
one, in order, without merging across a failure or past a finished chunk."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from verifypd.core.client import USAGE_KEYS, Chunk, Failure, StreamBox, merge_chunks
from verifypd.domain import convert
from verifypd.domain.requests import FinishReason
from verifypd.gateway.response_wire import ResponseEncoder, varint
from verifypd.v1 import generate_pb2


def _reference(request_id, ids, text, finish, usage, k, elapsed) -> bytes:
    return convert.response_to_pb(
        request_id, ids, text, finish, dict(zip(USAGE_KEYS, usage)), k, elapsed
    ).SerializeToString()


@pytest.mark.parametrize("seed", range(6))
def test_encoder_bytes_equal_the_protobuf_runtime(seed):
    rng = random.Random(seed)
    texts = ["", "a", " héllo", "日本語", "\U0001f600 x" * 40, "\n\t\"'\\"]
    finishes = [None, *FinishReason]
    for _ in range(400):
        request_id = rng.choice(["", "r", "req-" + "x" * rng.randrange(0, 300), "ü-id"])
        ids = [
            rng.choice([0, 1, 127, 128, 16383, 16384, 2**21, 2**32 - 1, rng.randrange(0, 200_000)])
            for _ in range(rng.randrange(0, 12))
        ]
        usage = [rng.choice([0, 1, 127, 128, rng.randrange(0, 1 << 20)]) for _ in USAGE_KEYS]
        args = (
            request_id,
            ids,
            rng.choice(texts),
            rng.choice(finishes),
            usage,
            rng.choice([0, 1, 3, 16, 300]),
            rng.choice([0.0, 1e-6, 0.123, 12345.678, rng.random()]),
        )
        got = ResponseEncoder(request_id).encode(*args[1:])
        assert got == _reference(*args), args
        assert generate_pb2.GenerateResponse.FromString(got) == generate_pb2.GenerateResponse.FromString(
            _reference(*args)
        )


def test_varint_matches_the_runtime_at_the_byte_boundaries():
    for n in (1, 127, 128, 255, 16383, 16384, 2**28, 2**32 - 1, 2**35):
        msg = generate_pb2.Usage(prompt_tokens=n) if n < 2**32 else None
        if msg is not None:
            assert msg.SerializeToString() == b"\x08" + varint(n)
    assert varint(-1) == b"\xff" * 9 + b"\x01"  # an enum's negative value: 64-bit two's complement


def _chunk(ids, text, finished=False, reason=None, k=0, ttft=None):
    return Chunk(list(ids), text, finished, reason, [1, len(ids), 0, 0, 1], k, ttft)


def test_merge_chunks_joins_runs_and_keeps_failures_and_finish_in_place():
    a, b, c = _chunk([1], "a", ttft=0.5), _chunk([2, 3], "bc", k=2), _chunk([4], "d", True, FinishReason.LENGTH, k=1)
    (merged,) = merge_chunks([a, b, c])
    assert (merged.token_ids, merged.text, merged.finished, merged.finish_reason) == (
        [1, 2, 3, 4],
        "abcd",
        True,
        FinishReason.LENGTH,
    )
    assert (merged.applied_k, merged.usage, merged.ttft_s) == (1, c.usage, 0.5)  # k, usage: last; TTFT: first
    fail = Failure(grpc.StatusCode.UNAVAILABLE, "gone")
    out = merge_chunks([a, b, fail, c])
    assert [type(x) for x in out] == [Chunk, Failure, Chunk] and out[0].token_ids == [1, 2, 3] and out[2] is c
    done = _chunk([9], "z", True, FinishReason.EOS)
    assert merge_chunks([done, a]) == [done, a]  # never past a finished chunk
    assert a.token_ids == [1] and b.token_ids == [2, 3]  # the inputs are not changed


def test_stream_box_gives_a_late_consumer_everything_as_one_chunk_in_order():
    async def main():
        box = StreamBox()
        got: list = []

        async def consume():
            while True:
                items = await box.take()
                got.append(items)
                if any(getattr(i, "finished", False) or isinstance(i, Failure) for i in items):
                    return

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the consumer waits
        box.put(_chunk([1], "a"))  # wakes it: alone
        await asyncio.sleep(0)
        for n in range(2, 6):  # four steps while the consumer does not run
            box.put(_chunk([n], chr(ord("a") + n - 1)))
        box.put(_chunk([6], "f", True, FinishReason.LENGTH))
        await asyncio.wait_for(task, 30)
        return got

    got = asyncio.run(main())
    assert [[c.token_ids for c in items] for items in got] == [[[1]], [[2, 3, 4, 5, 6]]]
    assert got[1][0].text == "bcdef" and got[1][0].finished


def test_stream_box_take_cancelled_while_waiting_loses_nothing():
    async def main():
        box = StreamBox()
        waiter = asyncio.create_task(box.take())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        box.put(_chunk([7], "x"))
        return await asyncio.wait_for(box.take(), 30)

    (item,) = asyncio.run(main())
    assert item.token_ids == [7]
