"""Moving KV between lane processes: by handle (import the owner's pool once) or by copy.

* Pool descriptors: what an owner announces (geometry + how to open it: a /dev/shm path on CPU,
  CUDA IPC fields on GPU). `open_pool` maps a peer's pool once per process (cached by id and
  generation; opening a handle twice in one process is a CUDA IPC error).
* Copy transport: the prefill lane computes into a local staging pool with the owner's geometry
  and pool id (so block ids mean the same), then streams the touched blocks, one
  `KvBlockChunk` per (block, layer), to the owner's `KvTransfer.WriteBlocks`.
* DraftProbs codec: float32 bytes via numpy, dense or top-k sparse (never pickle).
"""

from __future__ import annotations

import os
import threading

import grpc
import numpy as np
import torch

from verifypd.domain.lanes import KvHandle, PrefillItem
from verifypd.lanes.rpc import cuda_ipc
from verifypd.lanes.rpc.lane_convert import ROLE_FROM_PB, ROLE_TO_PB
from verifypd.model.kv_pool import LAYOUT, KvPool, PoolGeometry
from verifypd.net.lane_tls import LaneChannel
from verifypd.v1 import lanes_pb2, lanes_pb2_grpc

GRPC_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]


def host_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def geometry_of(d: lanes_pb2.PoolDescriptor) -> PoolGeometry:
    return PoolGeometry(d.num_layers, d.num_blocks, d.block_size, d.num_kv_heads, d.head_dim)


def describe_pool(pool: KvPool) -> lanes_pb2.PoolDescriptor:
    g = pool.geometry
    d = lanes_pb2.PoolDescriptor(
        pool_id=pool.pool_id,
        generation=pool.generation,
        role=ROLE_TO_PB[pool.role],
        host_boot_id=host_boot_id(),
        device_uuid=cuda_ipc.device_uuid(pool.device),
        layout=LAYOUT,
        dtype=dtype_name(pool.dtype),
        num_layers=g.num_layers,
        num_blocks=g.num_blocks,
        block_size=g.block_size,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        owner_pid=os.getpid(),
        window=pool.window,
    )
    if pool.device.type == "cuda":
        d.cuda_ipc.CopyFrom(cuda_ipc.share(pool.tensor))
    elif pool.shm_path:
        d.shm_path = pool.shm_path
    return d


def colocated(d: lanes_pb2.PoolDescriptor, device: torch.device) -> bool:
    """Same host and same device: the pool can be opened instead of copied."""
    shareable = d.WhichOneof("share") == ("cuda_ipc" if device.type == "cuda" else "shm_path")
    return shareable and d.host_boot_id == host_boot_id() and d.device_uuid == cuda_ipc.device_uuid(device)


_OPENED: dict[tuple[str, int], KvPool] = {}
_OPEN_LOCK = threading.Lock()


def release_imported() -> None:
    """Drops this process's mappings of peers' pools. With CUDA IPC the owner counts consumers'
    references; releasing them before exit lets the owner exit without a leak warning."""
    with _OPEN_LOCK:
        _OPENED.clear()


def open_pool(d: lanes_pb2.PoolDescriptor) -> KvPool:
    """Maps a peer's pool into this process; once per (pool id, generation)."""
    if d.layout != LAYOUT:
        raise ValueError(f"pool {d.pool_id} has layout {d.layout!r}; this version reads {LAYOUT!r}")
    key = (d.pool_id, d.generation)
    with _OPEN_LOCK:
        if key not in _OPENED:
            role, g, dtype = ROLE_FROM_PB[d.role], geometry_of(d), getattr(torch, d.dtype)
            if d.WhichOneof("share") == "cuda_ipc":
                tensor = cuda_ipc.open_tensor(d.cuda_ipc, d.device_uuid, g.shape, dtype)
                _OPENED[key] = KvPool(
                    role,
                    g,
                    dtype,
                    tensor.device,
                    tensor=tensor,
                    pool_id=d.pool_id,
                    generation=d.generation,
                    owner=False,
                )
            else:
                _OPENED[key] = KvPool.open_shared_cpu(role, g, dtype, d.shm_path, d.pool_id, d.generation)
        return _OPENED[key]


def staging_pool(d: lanes_pb2.PoolDescriptor, device: torch.device) -> KvPool:
    """A local pool with the owner's geometry and id: block ids mean the same in both."""
    return KvPool(
        ROLE_FROM_PB[d.role],
        geometry_of(d),
        getattr(torch, d.dtype),
        device,
        pool_id=d.pool_id,
        generation=d.generation,
        owner=False,
    )


# -- copy transport --------------------------------------------------------------------------
def block_bytes(pool: KvPool, block: int, layer: int) -> bytes:
    """K then V of one (block, layer): [2, block_size, kv_heads, head_dim] in the pool's dtype."""
    return pool.tensor[:, layer, block].contiguous().cpu().view(torch.uint8).numpy().tobytes()


def write_chunks(pool: KvPool, chunks: list[lanes_pb2.KvBlockChunk]) -> int:
    """Writes (block, layer) slices into the pool with one host-to-device copy."""
    g = pool.geometry
    for c in chunks:
        if c.pool_id != pool.pool_id or c.generation != pool.generation:
            raise ValueError(f"chunk for pool {c.pool_id}/{c.generation}, this is {pool.pool_id}/{pool.generation}")
        if not (c.block_id < g.num_blocks and c.layer < g.num_layers):
            raise ValueError(f"block {c.block_id} layer {c.layer} is outside the pool")
    if not chunks:
        return 0
    slice_shape = (2, g.block_size, g.num_kv_heads, g.head_dim)
    raw = b"".join(c.data for c in chunks)
    if len(raw) != len(chunks) * pool.dtype.itemsize * 2 * g.block_size * g.num_kv_heads * g.head_dim:
        raise ValueError("chunk data size does not match the pool's block geometry")
    # Bytes, not elements ([.., head_dim * itemsize]): one index_put for every pool dtype, fp8 included.
    src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(chunks), *slice_shape[:-1], -1)
    layers = torch.tensor([c.layer for c in chunks], device=pool.device)
    blocks = torch.tensor([c.block_id for c in chunks], device=pool.device)
    pool.tensor.view(torch.uint8)[:, layers, blocks] = src.to(pool.device).transpose(0, 1)  # [2, n, slot, head, dim]
    return len(raw)


def touched_blocks(block_ids, start: int, end: int, block_size: int) -> list[int]:
    """Blocks holding positions [start, end)."""
    return list(block_ids[start // block_size : -(-end // block_size)])


def prefill_blocks(items: list[PrefillItem], role: str, block_size: int) -> list[int]:
    """The blocks of the `role` pool that a prefill batch writes."""
    return [
        b
        for i in items
        for b in touched_blocks(_handle(i, role).block_ids, i.start_pos, i.start_pos + len(i.token_ids), block_size)
    ]


def _handle(item: PrefillItem, role: str) -> KvHandle:
    """The item's KV in the `role` pool (validated at the edge: a lane holding a draft pool gets
    every item's draft_kv)."""
    handle = item.target_kv if role == "target" else item.draft_kv
    if handle is None:
        raise RuntimeError(f"prefill item {item.request_id!r} has no {role}_kv, but this lane holds a {role} pool")
    return handle


class KvPusher:
    """Prefill side of the copy transport: streams staged blocks to the pool's owner."""

    def __init__(self, staging: KvPool, owner_addr: str, timeout_s: float = 60.0, metadata=(), tls=None):
        """`tls`: a verifypd.net.lane_tls.LaneTls: the push goes over mutual TLS (this lane presents
        the config's certificate; the owner's must chain to its CA)."""
        if not owner_addr:
            raise ValueError(f"pool {staging.pool_id}: copy transport needs the owner's kv_transfer_addr")
        self.pool = staging
        self.owner_addr = owner_addr
        self._lane_channel = LaneChannel(owner_addr, tls, GRPC_OPTIONS)
        self._stub = lanes_pb2_grpc.KvTransferStub(self._lane_channel.channel)
        self._timeout = timeout_s
        self._metadata = tuple(metadata)  # the lane secret: owners accept KV only from us

    def push(self, blocks: list[int]) -> int:
        if not blocks:
            return 0
        if self._lane_channel.refresh():  # rotated certificate files: new connections present the new one
            self._stub = lanes_pb2_grpc.KvTransferStub(self._lane_channel.channel)
        p = self.pool
        blocks = list(dict.fromkeys(blocks))
        # One device-to-host copy of all touched blocks: [n, layer, 2 * slot * head * dim bytes].
        index = torch.tensor(blocks, device=p.device)
        staged = p.tensor.index_select(2, index).permute(2, 1, 0, 3, 4, 5).contiguous().cpu()
        raw = staged.view(torch.uint8).numpy().reshape(len(blocks), p.geometry.num_layers, -1)
        chunks = (
            lanes_pb2.KvBlockChunk(
                pool_id=p.pool_id, generation=p.generation, block_id=b, layer=layer, data=raw[n, layer].tobytes()
            )
            for n, b in enumerate(blocks)
            for layer in range(p.geometry.num_layers)
        )
        try:
            return self._stub.WriteBlocks(chunks, timeout=self._timeout, metadata=self._metadata).bytes_written
        except grpc.RpcError as exc:  # one line for the caller (e.g. an owner refusing our certificate)
            raise RuntimeError(
                f"KV push to the owner at {self.owner_addr} failed: {exc.code().name}: {exc.details()}"
            ) from None


class KvTransferServicer(lanes_pb2_grpc.KvTransferServicer):
    """Owner side: writes/reads blocks of the pools this lane owns. Counts bytes received."""

    def __init__(self, pools: dict[str, KvPool], lock: threading.Lock):
        self.pools = pools
        self.lock = lock  # the lane's work lock: a write never races a forward on the same pool
        self.bytes_received = 0

    def _pool(self, pool_id: str, context) -> KvPool:
        if pool_id not in self.pools:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pool_id {pool_id!r} is not owned by this lane")
        return self.pools[pool_id]

    def WriteBlocks(self, request_iterator, context):
        # Bounded: a stream may not carry more bytes than all owned pools hold.
        limit = sum(p.tensor.numel() * p.tensor.element_size() for p in self.pools.values())
        chunks, total = [], 0
        for c in request_iterator:
            total += len(c.data)
            if total > limit:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream carries more than the pools' {limit} bytes")
            chunks.append(c)
        for pool_id in {c.pool_id for c in chunks}:
            pool = self._pool(pool_id, context)
            try:
                with self.lock:
                    written = write_chunks(pool, [c for c in chunks if c.pool_id == pool_id])
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.bytes_received += written
        return lanes_pb2.WriteBlocksReply(bytes_written=sum(len(c.data) for c in chunks))

    def ReadBlocks(self, request, context):
        pool = self._pool(request.pool_id, context)
        if request.generation != pool.generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"generation {request.generation} is not pool {pool.pool_id}'s ({pool.generation})",
            )
        if len(request.block_ids) > pool.geometry.num_blocks:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"block_ids: more than the pool's {pool.geometry.num_blocks}"
            )
        for block in request.block_ids:
            if block >= pool.geometry.num_blocks:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block_ids: {block} is outside the pool")
            for layer in range(pool.geometry.num_layers):
                with self.lock:
                    data = block_bytes(pool, block, layer)
                yield lanes_pb2.KvBlockChunk(
                    pool_id=pool.pool_id, generation=pool.generation, block_id=block, layer=layer, data=data
                )


# -- draft probabilities ---------------------------------------------------------------------
def encode_probs(probs: torch.Tensor, top_k: int) -> lanes_pb2.DraftProbs:
    """[rows, V] -> DraftProbs. With top-k truncation q has at most k non-zeros per row, so the
    k largest entries are exactly q (sparse); otherwise dense float32."""
    rows, vocab = probs.shape
    probs = probs.float().cpu()
    if 0 < top_k < vocab:
        values, ids = probs.topk(top_k, dim=-1)
        return lanes_pb2.DraftProbs(
            rows=rows,
            vocab_size=vocab,
            sparse_width=top_k,
            sparse_ids_u32=ids.numpy().astype("<u4").tobytes(),
            sparse_probs_f32=values.numpy().astype("<f4").tobytes(),
        )
    return lanes_pb2.DraftProbs(rows=rows, vocab_size=vocab, dense_f32=probs.numpy().astype("<f4").tobytes())


def decode_probs(d: lanes_pb2.DraftProbs, device: torch.device | str = "cpu") -> torch.Tensor:
    if d.sparse_width:
        ids = np.frombuffer(d.sparse_ids_u32, dtype="<u4").reshape(d.rows, d.sparse_width).astype(np.int64)
        vals = np.frombuffer(d.sparse_probs_f32, dtype="<f4").reshape(d.rows, d.sparse_width)
        dense = torch.zeros(d.rows, d.vocab_size, dtype=torch.float32)
        dense.scatter_(1, torch.from_numpy(ids), torch.from_numpy(vals.copy()))
    else:
        dense = torch.from_numpy(np.frombuffer(d.dense_f32, dtype="<f4").reshape(d.rows, d.vocab_size).copy())
    return dense.to(device)
