"""The peer and direct KV transports: prefill on one GPU, the pool's owner (verify or draft lane) on
another GPU of the same host (the DistServe / Dynamo / vLLM-PD shape on one node).

Peer: the prefill lane computes into a local staging pool with the owner's geometry and pool id (so block
ids mean the same in both, as the copy transport's), and maps the owner's pool into its own device
once (CUDA IPC; cudaIpcOpenMemHandle in this lane's context enables peer access, so a copy kernel
here writes the owner's memory over NVLink / PCIe). As soon as the forward has written layer i's
K/V (the model's `after_layer_kv` hook), the touched blocks of layer i are copied staging -> owner
on a side stream that waits on an event recorded after that layer: the copy of layer i overlaps
the compute of layers i + 1 .. L - 1, and only the last layer's copy is exposed after the forward.

On the CPU the owner's pool is its /dev/shm file and the copies run inline, layer by layer: the
same hook, block and layer bookkeeping, exercised by the tests with the lanes as processes.

Ordering: `finish()` makes the compute stream wait for the side stream; the lane synchronizes its
device before it replies, so an owner never reads a block before its copy landed.

Direct: no staging; the prefill lane's pool is the owner's, as mapped into its
own GPU's address space (`open_owner_pool`), so the forward's kernels store K/V straight into the
owner's memory (peer stores; attention over earlier chunks reads it back the same way). Ordering as
peer's: the lane synchronizes its device before it replies. On the CPU the pool is the owner's
/dev/shm file. `choose_transport` says when auto picks which.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from verifypd.lanes.rpc import cuda_ipc
from verifypd.lanes.rpc.kv_transport import colocated, geometry_of, host_boot_id, open_pool
from verifypd.lanes.rpc.lane_convert import ROLE_FROM_PB
from verifypd.model.kv_pool import KvPool
from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.lane.kv")
# Transports whose owners may run on another GPU: the lane orders their reads by synchronizing its
# device before it replies, never by an IPC event (recorded on this GPU, waited on by the owner's).
DEVICE_SYNCED = frozenset({"peer", "direct"})


def nixl_available() -> bool:
    """Whether NIXL (UCX/RDMA KV transfer across hosts) is importable. verifypd does not use it yet:
    across hosts KV goes over the gRPC copy stream either way (docs/services.md "KV transports")."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


def choose_transport(
    asked: str, d: lanes_pb2.PoolDescriptor, device: torch.device, stage_bound: int | None = None
) -> str:
    """How a prefill lane on `device` reaches pool `d` ("imported", "peer", "direct" or "copy") when the
    wiring asks for `asked` (auto | handle | peer | direct | copy); ValueError (one line, naming the
    pool) when the transport asked for cannot reach it. `stage_bound`: the most blocks this lane may
    stage for `d` (lane_setup.pool_blocks; None: no bound). auto: the same device -> imported; another
    GPU of this host that this one can reach as a peer -> peer when the stage fits the bound, else
    direct; else copy (on the CPU a reachable owner is a co-located one: auto imports there)."""
    near = colocated(d, device)
    if asked == "handle" and not near:
        raise ValueError(f"pool {d.pool_id} is on another host or device; use kv_transport copy")
    if near and asked in ("auto", "handle"):
        return "imported"
    if asked == "copy":
        return "copy"
    far = unreachable(d, device)
    if asked in ("peer", "direct"):
        if far is not None:
            raise ValueError(f"pool {d.pool_id}: kv_transport {asked}: {far}")
        return asked
    if far is not None:
        return "copy"
    # Staging was chosen for bandwidth: the forward writes its own GPU's memory and the copies are
    # bulk transfers that overlap the later layers. It costs a pool as large as the owner's on this
    # GPU; where that does not fit (a draft lane beside this one, an owner alone on a larger share
    # of its GPU), the forward writes the owner's pool directly: it trades some prefill time (its KV
    # writes, and attention reads of earlier chunks, go over NVLink) for no staging memory.
    if stage_bound is None or d.num_blocks <= stage_bound:
        log.info("pool %s: peer transport (a %d-block staging pool fits this lane)", d.pool_id, d.num_blocks)
        return "peer"
    log.info(
        "pool %s: direct transport (a %d-block staging pool exceeds this lane's %d blocks)",
        d.pool_id,
        d.num_blocks,
        stage_bound,
    )
    return "direct"


def unreachable(d: lanes_pb2.PoolDescriptor, device: torch.device) -> str | None:
    """Why the peer or direct transport cannot reach pool `d` from `device`; None: it can."""
    if d.host_boot_id != host_boot_id():
        return "the owner runs on another host (use kv_transport copy)"
    if device.type == "cpu":
        return None if d.WhichOneof("share") == "shm_path" else "the owner's pool is not in /dev/shm"
    if d.WhichOneof("share") != "cuda_ipc":
        return "the owner's pool has no CUDA IPC handle (a CPU owner)"
    try:
        owner = cuda_ipc.local_device_index(d.device_uuid)
    except RuntimeError as exc:
        return str(exc)
    index = cuda_index(device)
    if owner != index and not torch.cuda.can_device_access_peer(index, owner):
        return f"cuda:{index} cannot access cuda:{owner} as a peer (no NVLink / PCIe P2P)"
    return None


def cuda_index(device: torch.device) -> int:
    """`device`'s index ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


_MAPPED: dict[tuple[str, int], KvPool] = {}  # (pool id, generation) -> mapped pool: a handle opens once


def release_mapped() -> None:
    """Drops this process's mappings of the owners' pools (before exit: producers outlive consumers)."""
    _MAPPED.clear()


def open_owner_pool(d: lanes_pb2.PoolDescriptor, device: torch.device) -> KvPool:
    """The owner's pool as this process sees it: on CUDA mapped into `device`'s address space (the
    tensor is labelled `device`; its bytes live on the owner's GPU); on the CPU its /dev/shm file."""
    if device.type == "cpu":
        return open_pool(d)
    key = (d.pool_id, d.generation)
    if key not in _MAPPED:
        _MAPPED[key] = _map_owner_pool(d, device)
    return _MAPPED[key]


def _map_owner_pool(d: lanes_pb2.PoolDescriptor, device: torch.device) -> KvPool:
    g, dtype = geometry_of(d), getattr(torch, d.dtype)
    device = torch.device("cuda", cuda_index(device))
    storage = cuda_ipc.map_into(d.cuda_ipc, device)
    if g.bytes_per_block(dtype) * g.num_blocks > storage.nbytes():
        raise ValueError(f"pool {d.pool_id} does not fit the shared storage ({storage.nbytes()} bytes)")
    strides = torch.empty(g.shape, device="meta").stride()  # contiguous
    tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, g.shape, strides)
    role = ROLE_FROM_PB[d.role]
    return KvPool(role, g, dtype, device, tensor=tensor, pool_id=d.pool_id, generation=d.generation, owner=False)


@dataclass
class TransferStats:
    """One prefill call's copies into one pool. `exposed_s`: time the copies ran past the end of the
    forward (CUDA events; what overlap failed to hide); `span_s`: first copy start to last copy end."""

    pool_id: str
    blocks: int
    layers_hooked: int  # copied per layer while the forward ran; the rest after it (a graph replay)
    layers: int
    bytes: int
    span_s: float
    exposed_s: float

    def line(self) -> str:
        # Not a bandwidth: the span includes waiting for later layers' compute (overlap). The link's
        # bandwidth is bench/serving/disaggregation.py's peer-copy microbenchmark.
        return (
            f"peer KV copy into {self.pool_id}: {self.blocks} blocks x {self.layers} layers "
            f"({self.layers_hooked} overlapped), {self.bytes} bytes over {self.span_s * 1e3:.3f} ms, "
            f"{self.exposed_s * 1e3:.3f} ms after the forward"
        )


class PeerCopier:
    """Copies the touched blocks of one staging pool into its owner's pool, layer by layer."""

    def __init__(self, staging: KvPool, owner: KvPool):
        if staging.geometry != owner.geometry or staging.dtype != owner.dtype:
            raise ValueError(f"pool {owner.pool_id}: the staging pool's geometry or dtype differs from the owner's")
        self.staging, self.owner = staging, owner
        self.device = staging.device
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._index: torch.Tensor | None = None  # [n] touched block ids on the device; None: idle
        self._done: list[int] = []  # layers copied in this call, in order
        self._events: tuple | None = None  # CUDA: (first copy start, forward end, last copy end)
        self._cpu_seconds = 0.0
        self.last: TransferStats | None = None
        self.bytes_total = 0

    def begin(self, blocks: list[int]) -> None:
        """Arms the copier for one prefill call that writes `blocks` of the staging pool."""
        blocks = list(dict.fromkeys(blocks))
        self._index = torch.tensor(blocks, dtype=torch.long, device=self.device) if blocks else None
        self._done, self._cpu_seconds, self._events = [], 0.0, None
        if self.side is not None and blocks:
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))

    def layer_written(self, layer: int) -> None:
        """The model's after_layer_kv hook: layer `layer`'s K/V are queued on the current stream."""
        self._issue(layer)

    def _issue(self, layer: int) -> None:
        if self._index is None or layer in self._done:
            return
        self._done.append(layer)
        if self.side is None:
            t0 = time.perf_counter()
            self._copy(layer, self._index)
            self._cpu_seconds += time.perf_counter() - t0
            return
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))  # the compute stream, after this layer's K/V
        with torch.cuda.stream(self.side):
            self.side.wait_event(written)
            if len(self._done) == 1 and self._events is not None:
                self._events[0].record(self.side)  # the first copy starts
            self._copy(layer, self._index)

    def _copy(self, layer: int, index: torch.Tensor) -> None:
        # [2, n, block_size, kv_heads, head_dim] of this layer: gather from staging, scatter into the owner.
        src = self.staging.tensor[:, layer].index_select(1, index)
        self.owner.tensor[:, layer].index_copy_(1, index, src)

    def finish(self) -> int:
        """Copies the layers no hook announced (a CUDA graph replay runs none), orders the current
        stream after every copy and returns the bytes copied. Stats: `collect()` after a sync."""
        index = self._index
        if index is None:
            self.last = None
            return 0
        hooked = len(self._done)
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))  # the forward's end
        for layer in range(self.staging.geometry.num_layers):
            self._issue(layer)
        if self.side is not None:
            assert self._events is not None
            self._events[2].record(self.side)
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            index.record_stream(self.side)  # freed on the compute stream, read by the side stream
        g = self.staging.geometry
        nbytes = index.numel() * g.bytes_per_block(self.staging.dtype)
        self.last = TransferStats(self.owner.pool_id, index.numel(), hooked, g.num_layers, nbytes, 0.0, 0.0)
        self.bytes_total += nbytes
        self._index = None
        return nbytes

    def collect(self) -> TransferStats | None:
        """The last call's stats with its times filled in; call after the device is synchronized."""
        stats = self.last
        if stats is None:
            return None
        if self._events is not None:
            start, forward_end, copy_end = self._events
            stats.span_s = start.elapsed_time(copy_end) / 1e3
            stats.exposed_s = max(0.0, forward_end.elapsed_time(copy_end) / 1e3)
            self._events = None
        elif self.side is None:
            stats.span_s = stats.exposed_s = self._cpu_seconds
        log.info("%s", stats.line())
        return stats
