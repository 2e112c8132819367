"""The feature pool: target hidden states that feature drafts (EAGLE-style heads) read.

Addressed like the target's KV, by the same slots (block_id * block_size + offset): a request's
features live in its target blocks, so the router allocates nothing new and a draft reads them
through the target block table (`DraftItem.target_kv`). Every target forward (prefill, verify)
writes the captured layers of each new token at its slot, as it writes KV; positions whose drafts
were rejected are rewritten by the next verify before any draft reads them (a draft reads only
positions < target_computed): rollback by overwrite, like KV. No host sync: the write is an
index_put inside the forward (CUDA-graph safe); slot -1 (padding) lands on a scratch row.

    tensor [num_slots + 1, captures, Ht]   row num_slots = scratch
"""

from __future__ import annotations

import torch


class FeaturePool:
    def __init__(
        self, num_slots: int, capture_layers: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device
    ):
        """capture_layers: "output of layer i" ids (EagleConfig.aux_layer_ids), in feature order."""
        self.num_slots = num_slots
        self.capture_layers = tuple(capture_layers)
        self.tensor = torch.zeros(num_slots + 1, len(capture_layers), hidden, dtype=dtype, device=device)
        # input-of-layer index (what PagedLlama's loop sees) -> columns it fills
        self.at: dict[int, list[int]] = {}
        for column, layer in enumerate(self.capture_layers):
            self.at.setdefault(layer + 1, []).append(column)

    @staticmethod
    def bytes_per_slot(captures: int, hidden: int, dtype: torch.dtype) -> int:
        return captures * hidden * torch.empty((), dtype=dtype).element_size()

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots with -1 (write/read nowhere) sent to the scratch row."""
        return torch.where(slots >= 0, slots, self.num_slots)

    def write(self, input_of_layer: int, h: torch.Tensor, rows: torch.Tensor) -> None:
        """h [T, Ht]: the residual stream entering layer `input_of_layer` (copied: h may change in place);
        rows [T]: `rows(slots)` of the batch's slots (a forward resolves them once for all its writes)."""
        for column in self.at[input_of_layer]:
            self.tensor[:, column].index_copy_(0, rows, h)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """[T, captures * Ht] in capture order (what the head's fc takes)."""
        return self.tensor[self.rows(slots)].flatten(1)
