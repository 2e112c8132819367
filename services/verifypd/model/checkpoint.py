"""Tensor sources: checkpoint tensors by name, converted once to the serving dtype on the serving
device, cut to one tensor-parallel rank's slice (model.families.shard_rule).

    StateDictSource   over an in-memory state dict (GGUF through transformers, tests)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.families import ShardRule


def rank_slice(tensor: torch.Tensor, rule: ShardRule, rank: int, world: int, name: str = "") -> torch.Tensor:
    """Rank `rank`'s part of `tensor` under `rule` (a view when it is one slice, else a copy)."""
    if rule is None or world == 1:
        return tensor
    dim, sections = rule
    sizes = sections or (tensor.shape[dim],)
    if sum(sizes) != tensor.shape[dim]:
        raise ModelLoadError(f"tensor {name!r}: dim {dim} has {tensor.shape[dim]} entries, expected {sum(sizes)}")
    parts, start = [], 0
    for size in sizes:
        if size % world:
            raise ModelLoadError(f"tensor {name!r}: {size} entries along dim {dim} do not divide into {world} ranks")
        piece = size // world
        parts.append(tensor.narrow(dim, start + rank * piece, piece))
        start += size
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class StateDictSource:
    """A TensorSource over a state dict held in host memory."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        rule: Callable[[str], ShardRule] = lambda name: None,
        rank: int = 0,
        world: int = 1,
    ):
        self.state, self.device, self.dtype = state, device, dtype
        self.rule, self.rank, self.world = rule, rank, world

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        t = rank_slice(self.state[name], self.rule(name), self.rank, self.world, name)
        return t.to(device=self.device, dtype=dtype or self.dtype)
