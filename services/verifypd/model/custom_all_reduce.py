"""`CustomAllReduce`: a TpGroup whose all_reduce runs the one-shot / two-shot kernel over buffers
every rank has mapped (model/kernels/all_reduce.py), and hands what does not fit to NCCL.

Why: at decode batch sizes the tensor-parallel all-reduce is a few KB to a few hundred KB, where
NCCL's ring costs ~25-30 us a call on NVLink and the data movement is < 1 us. Reading the peers'
buffers directly over NVLink with one kernel (no host sync, so it is captured in CUDA graphs with
the rest of the forward) costs a launch, a signal round trip and the reads.

Paths, by the tensor's size in bytes (every rank takes the same path: the ranks reduce tensors of
the same size, dtype and layout in the same order):
    <= one_shot_max_bytes      one-shot (each rank reads all slots and sums)
    <= max_bytes               two-shot (reduce-scatter + all-gather through the slots)
    larger, other dtypes, non-contiguous, misaligned, other device: the fallback group (NCCL)

The buffers are made and mapped by lanes/tensor_parallel/all_reduce.py (CUDA IPC) or, in the CPU
tests, by the test (shared memory, two processes running the kernel under Triton's interpreter).
"""

from __future__ import annotations

import torch

# The kernel's fixed shape: programs per call (G, for the buffer's life) and elements per chunk.
DEFAULT_PROGRAMS = 32
DEFAULT_BLOCK = 2048  # 8 warps x 32 threads x 8 bf16 = 16 bytes a thread
DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_ONE_SHOT_MAX_BYTES = 512 << 10
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def signal_bytes(programs: int, world: int) -> int:
    """The signal words' region: int64 [programs, next_pow2(world)], rounded up to 256 bytes."""
    wpad = 1 << (world - 1).bit_length()
    return -(-programs * wpad * 8 // 256) * 256


def buffer_bytes(programs: int, world: int, max_bytes: int) -> int:
    """One rank's buffer: the signal words, then two data slots of `max_bytes` each."""
    return signal_bytes(programs, world) + 2 * max_bytes


class CustomAllReduce:
    """TpGroup (rank, world, all_reduce in place) over peer-mapped buffers; see the module doc.

    bases      int64 [world] on `device`: rank p's buffer (buffer_bytes long, zeroed before any
               rank's first call) as mapped in this process
    fallback   the group that reduces what the kernel does not take (and all_reduce_min,
               broadcast): a TorchDistributedGroup over NCCL
    keep       objects that own the mappings (kept alive as long as this group)
    """

    def __init__(
        self,
        fallback,
        bases: torch.Tensor,
        rank: int,
        world: int,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
        programs: int = DEFAULT_PROGRAMS,
        block: int = DEFAULT_BLOCK,
        keep: tuple = (),
    ):
        if not 2 <= world <= 8:
            raise ValueError(f"the custom all-reduce runs over 2..8 ranks, got {world}")
        if bases.dtype != torch.int64 or tuple(bases.shape) != (world,):
            raise ValueError(f"bases must be int64 [{world}], got {bases.dtype} {tuple(bases.shape)}")
        if max_bytes % 256:
            raise ValueError(f"max_bytes must be a multiple of 256, got {max_bytes}")
        self.fallback, self.rank, self.world = fallback, rank, world
        self.device = bases.device
        self.bases = bases
        self.max_bytes, self.one_shot_max_bytes, self.block = max_bytes, one_shot_max_bytes, block
        self.sig_bytes = signal_bytes(programs, world)
        # Per program: (signal rounds, calls); this rank's own, never shared (see the kernel's doc).
        self.state = torch.zeros(programs, 2, dtype=torch.int64, device=self.device)
        self._keep = keep

    def path(self, tensor: torch.Tensor) -> str:
        """'one-shot' | 'two-shot' | 'fallback' for this tensor (the same on every rank)."""
        nbytes = tensor.numel() * tensor.element_size()
        if (
            tensor.dtype not in DTYPES
            or tensor.device != self.device
            or not tensor.is_contiguous()
            or tensor.data_ptr() % 16
            or nbytes == 0
            or nbytes > self.max_bytes
        ):
            return "fallback"
        return "one-shot" if nbytes <= self.one_shot_max_bytes else "two-shot"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        path = self.path(tensor)
        if path == "fallback":
            self.fallback.all_reduce(tensor)
            return
        from verifypd.model.kernels.all_reduce import all_reduce_in_place

        all_reduce_in_place(
            tensor.view(-1),
            self.bases,
            self.state,
            self.rank,
            self.world,
            self.sig_bytes,
            self.max_bytes,
            two_shot=path == "two-shot",
            block=self.block,
        )

    def all_reduce_min(self, tensor: torch.Tensor) -> None:
        self.fallback.all_reduce_min(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.fallback.broadcast(tensor, src)
