"""Choosing and setting up the ranks' all-reduce (`--tp-all-reduce nccl|custom|auto`).

    nccl    every all-reduce through torch.distributed (NCCL)
    custom  model.custom_all_reduce.CustomAllReduce (one-shot / two-shot kernel over peer-mapped
            buffers, NCCL above its size limit); start-up fails (ModelLoadError) when it cannot run
    auto    custom where it can run, else nccl (default)

It can run when every rank is on a CUDA device, 2..8 ranks, every rank's GPU can access every
other's (peer access: NVLink or PCIe P2P on one host), and Triton is importable. The ranks decide
together (one all-reduce of their verdicts): a rank that chose alone would wait in a collective the
others never start. Set-up, the same on every rank, before any graph capture: a zeroed buffer per
rank (model.custom_all_reduce.buffer_bytes), its CUDA IPC handle to every rank through one NCCL
all-reduce of a byte table (protobuf bytes, no pickle), each peer's buffer mapped into this GPU
(lanes.rpc.cuda_ipc.map_into), then a self-check of both paths with known sums; a failed check
means NCCL (auto, all ranks agreeing) or a start-up error (custom).

NVLink multicast stays off: no multicast object, no multimem instruction, no NVLS (the kernel
uses plain loads and stores and point-to-point atomics only).
"""

from __future__ import annotations

import logging

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.lanes.rpc import cuda_ipc
from verifypd.model.custom_all_reduce import DEFAULT_MAX_BYTES, DEFAULT_PROGRAMS, CustomAllReduce, buffer_bytes
from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.tp")
MODES = ("auto", "custom", "nccl")
HANDLE_BYTES = 1024  # a serialized CudaIpcHandle is ~200 bytes


def obstacle(device: torch.device, world: int, devices: list[int]) -> str | None:
    """Why this rank cannot run the custom all-reduce, or None. `devices`: every rank's GPU index."""
    if device.type != "cuda":
        return f"the ranks run on {device.type}, not CUDA"
    if not 2 <= world <= 8:
        return f"it runs over 2..8 ranks, not {world}"
    for index in devices:
        if index != device.index and not torch.cuda.can_device_access_peer(device, index):
            return f"cuda:{device.index} cannot access cuda:{index} (no peer access: NVLink or PCIe P2P)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def agree(group, ok: bool, device: torch.device) -> bool:
    """True when every rank's `ok` is."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    group.all_reduce_min(flag)
    return bool(flag.item())


def gather_rows(group, row: torch.Tensor) -> torch.Tensor:
    """Every rank's `row` (uint8 [width], the same width everywhere), as [world, width]: one
    all-reduce of a table where each rank fills its own row."""
    table = torch.zeros(group.world, row.numel(), dtype=torch.int32, device=row.device)
    table[group.rank] = row.to(torch.int32)
    group.all_reduce(table)
    return table.to(torch.uint8)


def choose_group(group, device: torch.device, mode: str):
    """The TpGroup the model all-reduces with: `group` itself (NCCL) or a CustomAllReduce over it."""
    if mode not in MODES:
        raise ModelLoadError(f"--tp-all-reduce must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "nccl" or group.world == 1:
        return group
    mine = torch.tensor([device.index or 0], dtype=torch.uint8, device=device)
    devices = gather_rows(group, mine).view(-1).tolist()
    reason = obstacle(device, group.world, devices)
    if not agree(group, reason is None, device):
        return refuse(group, mode, reason or "another rank cannot run it")
    custom = None
    try:  # the same software on every rank: a failure here (before any kernel waits) fails everywhere
        custom = map_buffers(group, device)
        reason = self_check(custom)
    except (RuntimeError, OSError, ValueError) as exc:
        reason = f"set-up failed ({type(exc).__name__}: {exc})"
    if not agree(group, reason is None, device) or custom is None:  # every rank joins the agreement
        return refuse(group, mode, reason or "another rank's self-check failed")
    log.info("tensor-parallel rank %d: custom all-reduce over %d ranks", group.rank, group.world)
    return custom


def refuse(group, mode: str, reason: str):
    if mode == "custom":
        raise ModelLoadError(f"--tp-all-reduce custom: {reason}")
    log.info("tensor-parallel rank %d: NCCL all-reduce (custom path unavailable: %s)", group.rank, reason)
    return group


def map_buffers(group, device: torch.device) -> CustomAllReduce:
    """Each rank's zeroed buffer, shared with every rank and mapped here (module doc)."""
    buffer = torch.zeros(
        buffer_bytes(DEFAULT_PROGRAMS, group.world, DEFAULT_MAX_BYTES), dtype=torch.uint8, device=device
    )
    torch.cuda.synchronize(device)  # zeroed before any peer can signal into it
    handle = cuda_ipc.share(buffer).SerializeToString()
    if len(handle) > HANDLE_BYTES - 2:
        raise RuntimeError(f"a CUDA IPC handle of {len(handle)} bytes does not fit {HANDLE_BYTES}")
    row = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    row[:2] = torch.tensor([len(handle) >> 8, len(handle) & 255], dtype=torch.uint8)
    row[2 : 2 + len(handle)] = torch.frombuffer(bytearray(handle), dtype=torch.uint8)
    table = gather_rows(group, row.to(device)).cpu()
    bases: list[int] = []
    keep: list[object] = [buffer]
    for rank in range(group.world):
        if rank == group.rank:
            bases.append(buffer.data_ptr())
            continue
        size = int(table[rank, 0]) << 8 | int(table[rank, 1])
        peer = lanes_pb2.CudaIpcHandle.FromString(bytes(table[rank, 2 : 2 + size].tolist()))
        storage = cuda_ipc.map_into(peer, device)
        keep.append(storage)
        bases.append(storage.data_ptr())
    torch.cuda.synchronize(device)
    return CustomAllReduce(
        group, torch.tensor(bases, dtype=torch.int64, device=device), group.rank, group.world, keep=tuple(keep)
    )


def self_check(custom: CustomAllReduce) -> str | None:
    """Both kernel paths once with known sums (this also compiles them before any capture)."""
    world, device = custom.world, custom.device
    expected = world * (world + 1) / 2
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for nbytes in (8 << 10, custom.one_shot_max_bytes + (64 << 10)):
            x = torch.full((nbytes // dtype.itemsize,), float(custom.rank + 1), dtype=dtype, device=device)
            x[-1] = custom.rank  # a tail element: sum 0 + 1 + ... + (world - 1)
            path = custom.path(x)
            custom.all_reduce(x)
            torch.cuda.synchronize(device)
            body_ok = bool((x[:-1] == expected).all())
            tail_ok = float(x[-1]) == world * (world - 1) / 2
            if not (body_ok and tail_ok):
                return f"self-check of the {path} path ({dtype}, {nbytes} bytes) gave wrong sums"
    return None
