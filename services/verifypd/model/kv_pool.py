"""The KV pool: one contiguous tensor per model per device, allocated once.

Layout [2 (k, v), layers, num_blocks, block_size, kv_heads, head_dim]; block ids are offsets into
dim 2. The element type is the model dtype or float8_e4m3fn (`--kv-cache-dtype fp8`, model.kv_quant):
sizing goes by the element size, so an fp8 pool holds twice the blocks of a bf16 one in a budget.
On CPU the pool can live in a named shared-memory file so another process on the host can map the
very same bytes (the CPU twin of CUDA IPC, so CI exercises the handle path for real).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch

from verifypd.domain.lanes import PoolInfo

LAYOUT = "kv,layer,block,slot,head,dim"
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


class KvPool:
    def __init__(
        self,
        role: str,
        geometry: PoolGeometry,
        dtype: torch.dtype,
        device: torch.device,
        tensor: torch.Tensor | None = None,
        shm_path: str | None = None,
        pool_id: str | None = None,
        generation: int = 1,
        owner: bool = True,
    ):
        self.role = role
        # PoolInfo.window: set by whoever builds the pool for a model that slides in every layer.
        self.window = 0
        self.geometry = geometry
        self.dtype = dtype
        self.device = torch.device(device)
        self.pool_id = pool_id or f"{role}-{uuid.uuid4().hex[:12]}"
        self.generation = generation
        self.shm_path = shm_path
        self._owner = owner
        self.tensor = tensor if tensor is not None else torch.zeros(geometry.shape, dtype=dtype, device=self.device)

    @classmethod
    def create_shared_cpu(cls, role: str, geometry: PoolGeometry, dtype: torch.dtype) -> KvPool:
        """A CPU pool backed by a /dev/shm file that peers open by path."""
        pool_id = f"{role}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(SHM_DIR, f"verifypd-{pool_id}")
        numel = 1
        for d in geometry.shape:
            numel *= d
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(geometry.shape)
        tensor.zero_()
        return cls(role, geometry, dtype, torch.device("cpu"), tensor, shm_path=path, pool_id=pool_id)

    @classmethod
    def open_shared_cpu(
        cls, role: str, geometry: PoolGeometry, dtype: torch.dtype, path: str, pool_id: str, generation: int
    ) -> KvPool:
        numel = 1
        for d in geometry.shape:
            numel *= d
        if not os.path.exists(path):
            raise FileNotFoundError(f"shared KV pool {pool_id} not found at {path}")
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(geometry.shape)
        return cls(
            role,
            geometry,
            dtype,
            torch.device("cpu"),
            tensor,
            shm_path=path,
            pool_id=pool_id,
            generation=generation,
            owner=False,
        )

    def summary(self) -> str:
        """The start-up log's line: blocks, tokens, element type and bytes of this pool."""
        g = self.geometry
        size = g.num_blocks * g.bytes_per_block(self.dtype) / 2**30
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.role} KV pool: {g.num_blocks} blocks x {g.block_size} = {g.num_blocks * g.block_size} tokens, "
            f"{dtype}, {size:.2f} GiB on {self.device}"
        )

    def info(self) -> PoolInfo:
        g = self.geometry
        return PoolInfo(self.pool_id, self.generation, self.role, g.num_layers, g.num_blocks, g.block_size, self.window)

    def close(self) -> None:
        """The owner removes the shared file; mappings held by peers stay valid until unmapped."""
        if self._owner and self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)

    def __del__(self):  # best effort: never leave /dev/shm files behind
        try:
            self.close()
        except Exception:
            pass


def blocks_that_fit(geometry_one_block: PoolGeometry, dtype: torch.dtype, budget_bytes: int) -> int:
    return max(0, budget_bytes // geometry_one_block.bytes_per_block(dtype))
