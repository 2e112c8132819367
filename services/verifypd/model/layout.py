"""Batch layouts in host memory and their one-copy transfer to the device (torch + numpy, no model).

Batch layouts are built with numpy (no per-token Python loops) and cross to the device in one
copy. Two layouts:
  * ragged (prefill): the runs' tokens back to back;
  * padded (decode, verify, draft): every sequence gets exactly Q token slots, the batch is padded
    to a CUDA-graph bucket. Padding tokens repeat a real position and write nowhere (slot -1);
    padding sequences write nowhere either. Left-aligned (real tokens first) for verify, so row j
    of a sequence is its j-th token; right-aligned for drafting, so its last token is row Q - 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from verifypd.model.llama import BatchLayout


@dataclass
class TokenRun:
    """Consecutive tokens of one sequence: token_ids[i] sits at position start_pos + i."""

    token_ids: list[int]
    start_pos: int
    block_ids: tuple[int, ...]


@dataclass
class HostLayout:
    """A batch layout in host memory (int64 numpy arrays); `rows` sequences of which `real` hold runs."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: np.ndarray  # [rows, W]
    query_start: np.ndarray  # [rows + 1]
    max_query: int
    real: int


def build_layout(
    runs: list[TokenRun],
    block_size: int,
    *,
    query: int | None = None,
    align: str = "left",
    rows: int | None = None,
    width: int | None = None,
) -> HostLayout:
    """query=None: ragged. Else each sequence padded to `query` tokens (>= its run), the batch to
    `rows` sequences, block tables to `width` columns."""
    num = len(runs)
    if query is not None and (rows or num) * query <= SMALL_PADDED:
        return _padded_small(runs, block_size, query, align, num if rows is None else rows, width)
    lens = np.fromiter((len(r.token_ids) for r in runs), dtype=np.int64, count=num)
    starts = np.fromiter((r.start_pos for r in runs), dtype=np.int64, count=num)
    nblocks = np.fromiter((len(r.block_ids) for r in runs), dtype=np.int64, count=num)
    if (lens < 1).any():
        raise ValueError("every run needs at least one token")
    too_long = np.nonzero(starts + lens > nblocks * block_size)[0]
    if too_long.size:
        r = runs[int(too_long[0])]
        raise ValueError(f"run needs {r.start_pos + len(r.token_ids)} positions but holds {len(r.block_ids)} blocks")
    rows = num if rows is None else rows
    width = max(1, int(nblocks.max())) if width is None else width
    tables = np.zeros((rows, width), dtype=np.int64)
    for i, run in enumerate(runs):
        tables[i, : len(run.block_ids)] = run.block_ids
    flat_ids = np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in runs), dtype=np.int64, count=int(lens.sum())
    )
    run_start = np.concatenate(([0], np.cumsum(lens)[:-1]))
    if query is None:  # ragged
        seq = np.repeat(np.arange(num), lens)
        idx = np.arange(flat_ids.size) - run_start[seq]
        positions = starts[seq] + idx
        slots = tables[seq, positions // block_size] * block_size + positions % block_size
        query_start = np.concatenate(([0], np.cumsum(lens)))
        return HostLayout(flat_ids, positions, slots, tables, query_start, int(lens.max()), num)
    if lens.max() > query:
        raise ValueError(f"a run of {int(lens.max())} tokens does not fit {query} query slots")
    pad = rows - num
    lens_p = np.concatenate((lens, np.ones(pad, dtype=np.int64)))
    starts_p = np.concatenate((starts, np.zeros(pad, dtype=np.int64)))
    run_start_p = np.concatenate((run_start, np.zeros(pad, dtype=np.int64)))
    j = np.arange(query)[None, :]
    if align == "left":
        idx = np.minimum(j, lens_p[:, None] - 1)
        real = j < lens_p[:, None]
    else:
        offset = query - lens_p[:, None]
        idx = np.maximum(j - offset, 0)
        real = j >= offset
    real[num:] = False
    positions = starts_p[:, None] + idx
    ids = np.where(real, flat_ids[np.minimum(run_start_p[:, None] + idx, flat_ids.size - 1)], 0)
    seq = np.arange(rows)[:, None]
    slots = np.where(real, tables[seq, positions // block_size] * block_size + positions % block_size, -1)
    query_start = np.arange(rows + 1, dtype=np.int64) * query
    return HostLayout(ids.ravel(), positions.ravel(), slots.ravel(), tables, query_start, query, num)


# A padded layout of at most this many token slots is built in plain Python: a decode or verify
# step of a few requests is ~40 tiny numpy calls otherwise (~90 us of host time at batch 1, paid by
# every verify call and twice by every feature-draft call), ~12 us this way; numpy wins past ~160
# slots (measured on the dev CPU: 16 x 9 slots 90 against 129 us, 64 x 5 199 against 164 us).
SMALL_PADDED = 160


def _padded_small(
    runs: list[TokenRun], block_size: int, query: int, align: str, rows: int, width: int | None
) -> HostLayout:
    """build_layout's padded case, element by element (same arrays, same errors)."""
    num = len(runs)
    if width is None:
        width = max(1, max(len(r.block_ids) for r in runs))
    ids, positions, slots = [0] * (rows * query), [0] * (rows * query), [-1] * (rows * query)
    tables = np.zeros((rows, width), dtype=np.int64)
    for i, run in enumerate(runs):
        toks, start, blocks = run.token_ids, run.start_pos, run.block_ids
        n = len(toks)
        if n < 1:
            raise ValueError("every run needs at least one token")
        if start + n > len(blocks) * block_size:
            raise ValueError(f"run needs {start + n} positions but holds {len(blocks)} blocks")
        if n > query:
            raise ValueError(f"a run of {n} tokens does not fit {query} query slots")
        tables[i, : len(blocks)] = blocks
        base = i * query
        first = base if align == "left" else base + query - n  # where the real tokens begin
        # Padding slots repeat a real position (left: the last, right: the first) and write nowhere.
        positions[base : base + query] = [start + n - 1 if align == "left" else start] * query
        for j in range(n):
            p = start + j
            ids[first + j], positions[first + j] = toks[j], p
            slots[first + j] = blocks[p // block_size] * block_size + p % block_size
    query_start = np.arange(rows + 1, dtype=np.int64) * query
    return HostLayout(
        np.array(ids, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        np.array(slots, dtype=np.int64),
        tables,
        query_start,
        query,
        num,
    )


ALIGN = 16  # elements: every array starts 128-byte aligned in the packed buffer (Triton specializes
# kernels on 16-byte pointer alignment; misaligned views would compile extra variants)


def pack(arrays: list[np.ndarray], device: torch.device, staging: PinnedStaging | None = None) -> list[torch.Tensor]:
    """Copies int64 arrays to `device` in one transfer; returns flat device views, each aligned."""
    sizes = [a.size for a in arrays]
    offsets = np.concatenate(([0], np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes])))
    total = int(offsets[-1])
    host = staging.take(total) if staging is not None else torch.empty(total, dtype=torch.long)
    view = host.numpy()
    for a, off in zip(arrays, offsets):
        view[off : off + a.size] = a.ravel()
    flat = host.to(device, non_blocking=True) if device.type == "cuda" else host
    if staging is not None:
        staging.sent()
    return [flat[off : off + n] for off, n in zip(offsets, sizes)]


class PinnedStaging:
    """A reusable pinned host buffer (pinning per call costs more than the copy). One transfer may
    be in flight: `take` waits for the previous one before handing the memory out again."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        self._buffer = torch.empty(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._done = torch.cuda.Event() if device.type == "cuda" else None

    def take(self, size: int) -> torch.Tensor:
        if self.device.type != "cuda":  # no transfer: the arrays are used in place, so never reuse
            return torch.empty(size, dtype=torch.long)
        if self._done is not None:
            self._done.synchronize()
        if size > self._buffer.numel():
            self._buffer = torch.empty(2 * size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return self._buffer[:size]

    def sent(self) -> None:
        if self._done is not None:
            self._done.record()


def to_device(layout: HostLayout, device: torch.device, staging: PinnedStaging | None = None) -> BatchLayout:
    """One host-to-device copy of all index arrays."""
    ids, positions, slots, query_start, tables = pack(
        [layout.ids, layout.positions, layout.slots, layout.query_start, layout.tables], device, staging
    )
    return BatchLayout(
        input_ids=ids,
        positions=positions,
        slots=slots,
        query_start=query_start,
        block_tables=tables.view(layout.tables.shape),
        max_query=layout.max_query,
    )
