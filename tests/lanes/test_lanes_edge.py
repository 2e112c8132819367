"""Lane servers under hostile input: only callers with the secret get in, `ImportPools` opens only
the owners' own pool files within the lane's limits, bad input is INVALID_ARGUMENT naming the
field, stale handles are refused, an empty batch is a no-op, and a bounded fuzz over every lane
RPC never yields UNKNOWN or INTERNAL nor takes a lane down.

The three lane servers run in this process (real gRPC on 127.0.0.1, tiny models, CPU pools in
/dev/shm): a lane crash would crash the test.
"""

from __future__ import annotations

import os
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services_helpers import (
    VOCAB,
    engine_options,
)

from verifypd.v1 import generate_pb2, lanes_pb2, lanes_pb2_grpc

SECRET = "s3cret-for-tests-0123456789abcdef"
OK_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}
FUZZ_PER_RPC = 120
AUTH = (("x-verifypd-lane-secret", SECRET),)


class Lanes:
    def __init__(self, options):
        from verifypd.lanes.rpc.lane_ports import build_lane_server
        from verifypd.lanes.rpc.lane_server import LaneServicer

        self.servicers, self.servers, self.addrs, self.channels = {}, [], {}, {}
        for role in ("verify", "draft", "prefill"):
            servicer = LaneServicer(role, options, secret=SECRET)
            server, port, _ = build_lane_server(servicer, "127.0.0.1", 0)
            self.servicers[role], self.addrs[role] = servicer, f"127.0.0.1:{port}"
            self.servers.append(server)
            self.channels[role] = grpc.insecure_channel(self.addrs[role])
        self.prefill = lanes_pb2_grpc.PrefillLaneStub(self.channels["prefill"])
        self.draft = lanes_pb2_grpc.DraftLaneStub(self.channels["draft"])
        self.verify = lanes_pb2_grpc.VerifyLaneStub(self.channels["verify"])
        self.kv = {r: lanes_pb2_grpc.KvTransferStub(self.channels[r]) for r in ("draft", "verify")}
        self.pools = {
            "target": self.verify.Describe(lanes_pb2.LaneInfoRequest(), metadata=AUTH).pools[0],
            "draft": self.draft.Describe(lanes_pb2.LaneInfoRequest(), metadata=AUTH).pools[0],
        }
        self.wire()

    def descriptors(self, transport_addr=True):
        out = []
        for role, owner in (("target", "verify"), ("draft", "draft")):
            d = lanes_pb2.PoolDescriptor()
            d.CopyFrom(self.pools[role])
            d.kv_transfer_addr = self.addrs[owner]
            out.append(d)
        return out

    def wire(self):
        self.prefill.ImportPools(
            lanes_pb2.ImportPoolsRequest(pools=self.descriptors(), kv_transport="handle"), metadata=AUTH
        )

    def handle(self, role, blocks, seq_len):
        p = self.pools[role]
        return lanes_pb2.KvHandle(pool_id=p.pool_id, generation=p.generation, block_ids=blocks, seq_len=seq_len)

    def healthy(self) -> bool:
        return all(
            health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
            for c in self.channels.values()
        )

    def close(self):
        for server in self.servers:
            server.stop(0).wait(2)
        for servicer in self.servicers.values():
            servicer.close()


@pytest.fixture(scope="module")
def lanes(tiny_models):
    lanes = Lanes(engine_options(*tiny_models))
    yield lanes
    lanes.close()


def sampling(temperature=0.0, top_k=0):
    return lanes_pb2.LaneSampling(params=generate_pb2.SamplingParams(temperature=temperature, top_k=top_k), seed=7)


def prefill_batch(lanes):
    return lanes_pb2.PrefillBatch(
        items=[
            lanes_pb2.PrefillItem(
                request_id="a",
                token_ids=[5, 6, 7],
                start_pos=0,
                target_kv=lanes.handle("target", [0], 0),
                draft_kv=lanes.handle("draft", [0], 0),
                is_last_chunk=True,
                sampling=sampling(),
            )
        ]
    )


def draft_batch(lanes, temperature=0.8, top_k=0):
    return lanes_pb2.DraftBatch(
        items=[
            lanes_pb2.DraftItem(
                request_id="a",
                input_tokens=[7],
                start_pos=3,
                draft_kv=lanes.handle("draft", [0, 1], 3),
                k=2,
                sampling=sampling(temperature, top_k),
            )
        ]
    )


def verify_batch(lanes, probs=None):
    item = lanes_pb2.VerifyItem(
        request_id="a",
        pending_token=7,
        start_pos=3,
        draft_tokens=[8, 9],
        target_kv=lanes.handle("target", [0, 1], 3),
        sampling=sampling(0.8),
    )
    if probs is not None:
        item.draft_probs.CopyFrom(probs)
    return lanes_pb2.VerifyBatch(items=[item])


def code_of(fn, *args, **kwargs):
    kwargs.setdefault("metadata", AUTH)
    try:
        result = fn(*args, timeout=30, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def wire_probs(rows: int = 2) -> lanes_pb2.DraftProbs:
    """A valid dense DraftProbs. Draft lanes send none any more (coupled acceptance needs only the
    tokens), but the verify lane still accepts and validates them from older draft lanes."""
    import numpy as np

    return lanes_pb2.DraftProbs(
        rows=rows, vocab_size=VOCAB, dense_f32=np.full((rows, VOCAB), 1 / VOCAB, "<f4").tobytes()
    )


def test_valid_calls_work(lanes):
    assert code_of(lanes.prefill.Prefill, prefill_batch(lanes))[0] == grpc.StatusCode.OK
    reply = lanes.draft.Draft(draft_batch(lanes), metadata=AUTH)
    assert len(reply.outputs[0].draft_tokens) == 2 and reply.outputs[0].probs.rows == 0  # sampled: tokens only
    assert code_of(lanes.verify.Verify, verify_batch(lanes))[0] == grpc.StatusCode.OK
    assert code_of(lanes.verify.Verify, verify_batch(lanes, wire_probs()))[0] == grpc.StatusCode.OK


def test_every_lane_rpc_needs_the_secret(lanes):
    calls = [
        (lanes.prefill.Describe, lanes_pb2.LaneInfoRequest()),
        (lanes.prefill.Prefill, prefill_batch(lanes)),
        (lanes.prefill.ImportPools, lanes_pb2.ImportPoolsRequest()),
        (lanes.draft.Draft, draft_batch(lanes)),
        (lanes.verify.Verify, verify_batch(lanes)),
        (lanes.verify.Describe, lanes_pb2.LaneInfoRequest()),
        (lanes.kv["verify"].ReadBlocks, lanes_pb2.ReadBlocksRequest(pool_id=lanes.pools["target"].pool_id)),
    ]
    for wrong in ((), (("x-verifypd-lane-secret", "guess"),), (("x-verifypd-lane-secret", SECRET + "x"),)):
        for fn, request in calls:
            assert code_of(fn, request, metadata=wrong)[0] == grpc.StatusCode.UNAUTHENTICATED, fn
        with pytest.raises(grpc.RpcError) as err:
            lanes.kv["draft"].WriteBlocks(
                iter([lanes_pb2.KvBlockChunk(pool_id=lanes.pools["draft"].pool_id)]), metadata=wrong, timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert lanes.healthy()  # health stays open for probes


def import_code(lanes, mutate, transport="handle"):
    pools = lanes.descriptors()
    mutate(pools[0])
    return code_of(lanes.prefill.ImportPools, lanes_pb2.ImportPoolsRequest(pools=pools, kv_transport=transport))


def test_import_pools_validates_every_field(lanes, tmp_path):
    link = f"/dev/shm/verifypd-target-{os.getpid():012x}"
    os.symlink(lanes.pools["target"].shm_path, link)
    try:
        cases = {
            "shm_path": lambda d: setattr(d, "shm_path", "/etc/passwd"),
            "shm_path ": lambda d: setattr(d, "shm_path", "/dev/shm/../etc/passwd"),
            "shm_path  ": lambda d: (
                setattr(d, "pool_id", link.rsplit("verifypd-", 1)[1]),
                setattr(d, "shm_path", link),
            ),
            "num_blocks": lambda d: setattr(d, "num_blocks", 1 << 20),
            "dtype": lambda d: setattr(d, "dtype", "float64"),
            "layout": lambda d: setattr(d, "layout", "kv,block,layer,slot,head,dim"),
            "head_dim": lambda d: setattr(d, "head_dim", 4096),
            "pool_id": lambda d: setattr(d, "pool_id", "../../x"),
            "kv_transfer_addr": lambda d: setattr(d, "kv_transfer_addr", "evil host:1"),
        }
        for field, mutate in cases.items():
            code, details = import_code(lanes, mutate)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
            assert f"pools[0].{field.strip()}" in details, details
        # The copy transport allocates a staging pool: bounded by the lane's own limit too.
        code, details = import_code(lanes, lambda d: setattr(d, "num_blocks", 1 << 20), "copy")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_blocks" in details
    finally:
        os.unlink(link)
    # Nothing above changed the wiring: the lane still computes into the real pools.
    assert code_of(lanes.prefill.Prefill, prefill_batch(lanes))[0] == grpc.StatusCode.OK


@pytest.mark.parametrize(
    "case",
    [
        "sparse id beyond vocab",
        "k = 0",
        "huge position",
        "block outside pool",
        "too few blocks",
        "token beyond vocab",
        "nan temperature",
        "probs size",
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(lanes, case):
    d, v, p = draft_batch(lanes), verify_batch(lanes), prefill_batch(lanes)
    sparse = lanes_pb2.DraftProbs(
        rows=2,
        vocab_size=VOCAB,
        sparse_width=1,
        sparse_ids_u32=(VOCAB + 5).to_bytes(4, "little") * 2,
        sparse_probs_f32=b"\x00\x00\x80\x3f" * 2,
    )
    if case == "sparse id beyond vocab":
        fn, request, field = lanes.verify.Verify, verify_batch(lanes, sparse), "items[0].draft_probs.sparse_ids"
    elif case == "k = 0":
        d.items[0].k = 0
        fn, request, field = lanes.draft.Draft, d, "items[0].k"
    elif case == "huge position":
        v.items[0].start_pos = 2**31 + 2
        fn, request, field = lanes.verify.Verify, v, "items[0].target_kv"
    elif case == "block outside pool":
        p.items[0].target_kv.block_ids.append(10**6)
        fn, request, field = lanes.prefill.Prefill, p, "items[0].target_kv.block_ids"
    elif case == "too few blocks":
        d.items[0].k = 9
        fn, request, field = lanes.draft.Draft, d, "items[0].draft_kv.block_ids"
    elif case == "token beyond vocab":
        p.items[0].token_ids.append(VOCAB)
        fn, request, field = lanes.prefill.Prefill, p, "items[0].token_ids"
    elif case == "nan temperature":
        d.items[0].sampling.params.temperature = float("nan")
        fn, request, field = lanes.draft.Draft, d, "items[0].sampling"
    else:
        bad = lanes_pb2.DraftProbs(rows=2, vocab_size=VOCAB, dense_f32=b"\0" * 12)
        fn, request, field = lanes.verify.Verify, verify_batch(lanes, bad), "items[0].draft_probs.dense_f32"
    code, details = code_of(fn, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), (code, details)


def test_empty_batches_are_no_ops(lanes):
    assert not lanes.prefill.Prefill(lanes_pb2.PrefillBatch(), metadata=AUTH).outputs
    assert not lanes.draft.Draft(lanes_pb2.DraftBatch(), metadata=AUTH).outputs
    assert not lanes.verify.Verify(lanes_pb2.VerifyBatch(), metadata=AUTH).outputs


def test_stale_generation_is_refused(lanes):
    batch = draft_batch(lanes)
    batch.items[0].draft_kv.generation -= 1
    code, details = code_of(lanes.draft.Draft, batch)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "generation" in details
    code, _ = code_of(
        lanes.kv["draft"].ReadBlocks,
        lanes_pb2.ReadBlocksRequest(
            pool_id=lanes.pools["draft"].pool_id, generation=lanes.pools["draft"].generation - 1, block_ids=[0]
        ),
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION


# -- fuzz ------------------------------------------------------------------------------------
EDGE = {
    "uint": [0, 1, 2, 3, 4, 7, 8, 16, 17, 63, 64, 65, VOCAB - 1, VOCAB, 255, 256, 4096, 2**31, 2**32 - 1],
    "int": [0, 1, -1, 5, VOCAB, 2**31 - 1, -(2**31)],
    "float": [0.0, 1e-45, -0.0, 0.5, 1.0, 2.0, float("nan"), float("inf"), -1.0, 1e30],
}


def mutate(msg, rng: random.Random, lanes, depth=0):
    """Randomly rewrites some fields of a well-formed message (recursively), keeping it parseable."""
    from google.protobuf.descriptor import FieldDescriptor as F

    scalar = (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_FLOAT, F.TYPE_DOUBLE)
    scalar += (F.TYPE_BOOL, F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_ENUM)  # the types edge_value() fills
    for field in msg.DESCRIPTOR.fields:
        if field.type == F.TYPE_MESSAGE:
            if field.is_repeated:
                items = getattr(msg, field.name)
                if rng.random() < 0.1 and len(items):
                    items.add().CopyFrom(items[0])  # duplicates
                for sub in items:
                    mutate(sub, rng, lanes, depth + 1)
            elif depth < 4 and (msg.HasField(field.name) or rng.random() < 0.1):
                mutate(getattr(msg, field.name), rng, lanes, depth + 1)
            continue
        if rng.random() > 0.25:
            continue
        if field.type not in scalar:
            continue
        if field.is_repeated:
            target = getattr(msg, field.name)
            del target[:]
            target.extend(edge_value(field.type, rng, lanes) for _ in range(rng.choice([0, 1, 2, 5, 17])))
        else:
            setattr(msg, field.name, edge_value(field.type, rng, lanes))


def edge_value(kind: int, rng: random.Random, lanes):
    """A hostile value for a scalar protobuf field of type `kind` (a FieldDescriptor.TYPE_*)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    if kind in (F.TYPE_UINT32, F.TYPE_UINT64):
        return rng.choice(EDGE["uint"] + ([2**64 - 1] if kind == F.TYPE_UINT64 else []))
    if kind in (F.TYPE_INT32, F.TYPE_INT64):
        return rng.choice(EDGE["int"])
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice(EDGE["float"])
    if kind == F.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == F.TYPE_STRING:
        return rng.choice(
            [
                "",
                "x",
                "../../etc/passwd",
                "a" * 300,
                lanes.pools["draft"].pool_id,
                lanes.pools["target"].pool_id,
                "/dev/shm/verifypd-x",
            ]
        )
    if kind == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 3, 4, 8, 4 * VOCAB, 8 * VOCAB]))
    assert kind == F.TYPE_ENUM, kind
    return rng.choice([0, 1, 2, 99])


def test_fuzz_every_lane_rpc_never_unknown_internal_or_crash(lanes):
    rng = random.Random(1234)
    probs = wire_probs()
    seen: dict[str, dict] = {}

    def run(name, fn, base_fn, stream=False):
        for _ in range(FUZZ_PER_RPC):
            msg = base_fn()
            mutate(msg, rng, lanes)
            arg = iter([msg] * rng.choice([1, 2])) if stream else msg
            code, details = code_of(fn, arg)
            seen.setdefault(name, {}).setdefault(code, details)
            assert code in OK_CODES, f"{name}: {code.name}: {details}\n{msg}"

    run("Prefill", lanes.prefill.Prefill, lambda: prefill_batch(lanes))
    run("Draft", lanes.draft.Draft, lambda: draft_batch(lanes, rng.choice([0.0, 0.8]), rng.choice([0, 5])))
    run("Verify", lanes.verify.Verify, lambda: verify_batch(lanes, probs))
    run("Describe", lanes.verify.Describe, lambda: lanes_pb2.LaneInfoRequest())
    run(
        "ReadBlocks",
        lanes.kv["verify"].ReadBlocks,
        lambda: lanes_pb2.ReadBlocksRequest(
            pool_id=lanes.pools["target"].pool_id, generation=lanes.pools["target"].generation, block_ids=[0]
        ),
    )
    chunk = next(
        iter(
            lanes.kv["draft"].ReadBlocks(
                lanes_pb2.ReadBlocksRequest(
                    pool_id=lanes.pools["draft"].pool_id, generation=lanes.pools["draft"].generation, block_ids=[0]
                ),
                metadata=AUTH,
            )
        )
    )
    run(
        "WriteBlocks",
        lanes.kv["draft"].WriteBlocks,
        lambda: lanes_pb2.KvBlockChunk.FromString(chunk.SerializeToString()),
        stream=True,
    )
    run(
        "ImportPools",
        lanes.prefill.ImportPools,
        lambda: lanes_pb2.ImportPoolsRequest(pools=lanes.descriptors(), kv_transport=rng.choice(["handle", "copy"])),
    )
    # Every RPC saw both accepted and refused input, and the lanes still serve correctly.
    assert all(grpc.StatusCode.INVALID_ARGUMENT in codes for name, codes in seen.items() if name != "Describe"), seen
    assert lanes.healthy()
    lanes.wire()
    test_valid_calls_work(lanes)
