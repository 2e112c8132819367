"""CUDA IPC of one KV pool tensor, spelled out as the explicit fields of `CudaIpcHandle`.

Import-safe without CUDA: nothing here touches the device until called. The owner calls
`share(tensor)` once; an importer calls `open_tensor(desc)` once per process (the caller caches).

Pitfalls this module respects (see ARCHITECTURE.md, "KV handles"):
  * the handle names the whole allocation segment: the pool is one dedicated tensor, and we carry
    the storage's byte offset/size inside that segment;
  * device indices are process-local: the importer finds its own index by the device UUID;
  * the producer must outlive consumers and must keep the shared storage alive: `share` keeps a
    reference in `_SHARED` (the pool lives for the process anyway);
  * IPC shares memory, not ordering: writers synchronize before replying (lane_server does).
"""

from __future__ import annotations

import torch

from verifypd.v1 import lanes_pb2

_SHARED: dict[int, tuple] = {}  # data_ptr -> (storage, share tuple): keeps the producer side alive


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(
        f"no local CUDA device has UUID {uuid}: CUDA IPC needs the same GPU (use --kv-transport copy across GPUs)"
    )


def share(tensor: torch.Tensor) -> lanes_pb2.CudaIpcHandle:
    if not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise ValueError("share the pool tensor itself (contiguous, offset 0), not a view")
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key not in _SHARED:
        _SHARED[key] = (storage, storage._share_cuda_())
    (_device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = _SHARED[key][1]
    return lanes_pb2.CudaIpcHandle(
        mem_handle=bytes(handle),
        storage_offset_bytes=offset_bytes,
        storage_size_bytes=size_bytes,
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=ref_offset,
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


def open_tensor(h: lanes_pb2.CudaIpcHandle, uuid: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Maps the owner's pool into this process (same bytes, no copy)."""
    index = local_device_index(uuid)
    torch.cuda._lazy_init()
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            h.mem_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize > h.storage_size_bytes:
        raise ValueError(
            f"pool of {numel * dtype.itemsize} bytes does not fit the shared storage ({h.storage_size_bytes} bytes)"
        )
    return tensor.set_(storage, 0, shape, ())  # stride (): contiguous, set_'s default


def map_into(h: lanes_pb2.CudaIpcHandle, device: torch.device) -> torch.UntypedStorage:
    """Maps another process's allocation (possibly on another GPU) into `device`'s address space:
    cudaIpcOpenMemHandle in `device`'s context, which enables peer access to the owner's GPU. The
    storage's data_ptr is then valid in kernels running on `device` (reads and writes go over
    NVLink / PCIe); torch labels the storage with `device`, not the owner's GPU, so use its address,
    not its tensors' device."""
    torch.cuda._lazy_init()
    with torch.cuda.device(device):
        return torch.UntypedStorage._new_shared_cuda(
            device.index,
            h.mem_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
