"""Structured output on the device: packed token bitmasks applied to logits (verifypd.domain.grammar
makes them on the host). A masked-out token's logit becomes -inf, so its probability is 0 under every
temperature / top-k / top-p and it can win neither the argmax nor the race (model.sampler): the
choice is made from the target's distribution restricted to the grammar's tokens. Applied where the
sampling controls leave off, before temperature and truncation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_BITS = 32


def stack_masks(masks: Sequence[np.ndarray | None], rows: int, words: int) -> np.ndarray:
    """Per-item masks ([n_i, words], n_i <= rows; None: unconstrained) -> int32 [items, rows, words],
    all ones (every token allowed) where an item has no mask or fewer rows."""
    out = np.full((len(masks), rows, words), -1, dtype=np.int32)
    for n, m in enumerate(masks):
        if m is not None:
            if m.ndim != 2 or m.shape[1] != words or m.shape[0] > rows:
                raise ValueError(f"token mask of item {n}: shape {m.shape}, expected at most [{rows}, {words}]")
            out[n, : m.shape[0]] = m
    return out


def unpack(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [..., words] -> bool [..., vocab]: token v allowed iff bit v % 32 of word v // 32 is set."""
    shifts = torch.arange(_BITS, device=masks.device, dtype=torch.int32)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # [..., words, 32]
    return bits.flatten(-2)[..., :vocab].bool()


def allowed(masks: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
    """Host bitmasks [..., ceil(V/32)] -> bool [..., V] on the logits' device: the tokens they allow."""
    vocab = logits.shape[-1]
    if masks.shape[-1] * _BITS < vocab:
        raise ValueError(f"token mask covers {masks.shape[-1] * _BITS} ids, logits have {vocab}")
    host = torch.from_numpy(masks)
    if logits.is_cuda:  # pinned: a pageable copy would wait for the stream's queued work (sampler.small_tensor)
        host = host.pin_memory()
    return unpack(host.to(logits.device, non_blocking=True), vocab)


def apply_token_mask(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """logits [..., V] masked by host bitmasks [..., ceil(V/32)] (same leading shape): a new tensor."""
    return logits.masked_fill(~allowed(masks, logits), float("-inf"))


def apply_masks(
    logits: torch.Tensor, masks: Sequence[np.ndarray | None], fallback: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [R, P, V] and one host mask per row (int32 [<= P, words], None: unconstrained) -> the
    masked logits; `logits` itself when no row has a mask. The lanes' mask seam (lanes.local:
    after the sampling controls, before temperature / top-k / top-p).

    `fallback` [R, P, V] (the raw logits): where the controls left the grammar no token (min_tokens
    holds back the EOS that is all a finished grammar allows), that position is chosen from the
    fallback under the mask instead: the grammar wins over min_tokens, and the output still parses."""
    present = [m for m in masks if m is not None]
    if not present:
        return logits
    ok = allowed(stack_masks(masks, logits.shape[1], present[0].shape[-1]), logits)
    out = logits.masked_fill(~ok, float("-inf"))
    if fallback is None:
        return out
    dead = torch.isneginf(out).all(-1, keepdim=True)  # [R, P, 1]
    return torch.where(dead, fallback.to(out.dtype).masked_fill(~ok, float("-inf")), out)
