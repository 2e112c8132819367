"""Our paged forward against transformers' forward, logit row by logit row (the family tests)."""

from __future__ import annotations

import torch
from engine_helpers import DEVICE

from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.runner import TokenRun, build_layout


def forward_runs(model: PagedLlama, pool, runs: list[TokenRun], block_size: int) -> torch.Tensor:
    """Logits of every new token of the runs (one ragged batch)."""
    lay = build_layout(runs, block_size)
    to = lambda a, dtype=torch.long: torch.tensor(a, dtype=dtype, device=DEVICE)  # noqa: E731
    batch = BatchLayout(
        to(lay.ids),
        to(lay.positions),
        to(lay.slots),
        to(lay.tables, torch.int32),
        to(lay.query_start, torch.int32),
        lay.max_query,
    )
    return model.forward(pool, batch, torch.arange(len(lay.ids), device=DEVICE))


def relative_logit_errors(model: PagedLlama, hf, decode_steps: int = 5) -> list[float]:
    """Two sequences prefilled together, then decoded together token by token through the paged KV
    (shuffled block ids, contexts crossing blocks): per sequence, the relative error of all its
    logit rows against transformers' forward of the whole sequence."""
    s, block_size = model.shape, 4
    pool = torch.zeros(2, s.num_layers, 16, block_size, s.num_kv_heads, s.head_dim, device=DEVICE)
    seqs = [[5, 17, 40, 8, 9, 60, 33], [71, 3, 12, 12, 90, 44, 45, 46, 47, 11, 29]]
    blocks = [(9, 2, 14, 5), (0, 11, 7, 3, 12)]
    logits = forward_runs(model, pool, [TokenRun(q, 0, b) for q, b in zip(seqs, blocks)], block_size)
    rows = [list(logits[: len(seqs[0])]), list(logits[len(seqs[0]) :])]
    for _ in range(decode_steps):
        nxt = [int(r[-1].argmax()) for r in rows]
        step = forward_runs(model, pool, [TokenRun([t], len(q), b) for t, q, b in zip(nxt, seqs, blocks)], block_size)
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            rows[i].append(step[i])
    errors = []
    for seq, ours in zip(seqs, rows):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        got = torch.stack(ours).cpu()[: len(seq)]
        errors.append(((got - ref).norm() / ref.norm()).item())
    return errors
