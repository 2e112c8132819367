"""Token choice and lossless speculative acceptance, vectorized over a batch.

Randomness is counter-based: every uniform is a hash of (request seed, token position, stream),
so results do not depend on batch composition, lane placement or device, and a request with a
fixed seed is reproducible. Streams: 0 draws the draft token, 1 the accept test, 2 the target's
own token (first token, correction or bonus).

Acceptance (Leviathan et al. 2023; Chen et al. 2023): draft token d_i ~ q_i is kept with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
norm(max(p_i - q_i, 0)); if all k are kept a bonus token is drawn from p_k. Greedy requests are
the special case p = one-hot(argmax), q = one-hot(draft), handled by a fast path.
"""
from __future__ import annotations

import torch

from verifypd.engine.types import GREEDY_BELOW

STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET = 0, 1, 2
NO_TOKEN = -1  # sample() of a row whose distribution is NaN or empty
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) in int64 arithmetic that never overflows."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform floats in (0, 1), one per (seed, position); same on every device. Inputs int64."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    x = _mix32(_mix32(_mix32(lo) ^ hi) ^ positions) ^ (stream * 0x9E3779B9 & _MASK32)
    x = _mix32(x)
    return ((x.double() + 0.5) / 4294967296.0).float()


def small_tensor(values, device, dtype=torch.long) -> torch.Tensor:
    """A small host list on `device` without a host sync. `torch.tensor(values, device=cuda)` copies
    from pageable memory and so waits for all work queued on the current stream: inside a lane call
    that stalls the host until the GPU catches up (and, with the prefill launched beside a verify
    call, would serialize them). Pinned memory and an asynchronous copy queue it instead; the
    caching host allocator keeps the pinned block until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def params_tensor(samplings, device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, seeds) of a batch's SamplingParams, on `device`."""
    temp = small_tensor([s.temperature for s in samplings], device, torch.float32)
    top_k = small_tensor([s.top_k for s in samplings], device)
    top_p = small_tensor([s.top_p for s in samplings], device, torch.float32)
    return temp, top_k, top_p, seed_tensor([s.seed for s in samplings], device)


def seed_tensor(seeds: list[int], device) -> torch.Tensor:
    """uint64 seeds as int64 bit patterns."""
    return small_tensor([s - (1 << 64) if s >= (1 << 63) else s for s in seeds], device)


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, truncate: bool | None = None) -> torch.Tensor:
    """logits [N, V] float32 -> processed probs [N, V]. Rows with temperature 0 become one-hot
    argmax, and so do tiny ones (below GREEDY_BELOW: logits / 1e-45 is inf, whose softmax is
    NaN). top_k 0 and top_p 1 disable truncation. `truncate` says whether any row truncates;
    None looks (a host sync), so CUDA-graph code passes it from the host-side parameters."""
    greedy = temperature < GREEDY_BELOW
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    vocab = probs.shape[-1]
    if truncate is None:
        truncate = bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any())
    if truncate:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        keep = rank < k[:, None]
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep &= mass_before < top_p[:, None]
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(probs.dtype)
    return torch.where(greedy[:, None], one_hot, probs)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [N, V], u [N] in (0, 1) -> token ids [N]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    # Never a token from a broken distribution (NaN/inf, or no mass): such rows give NO_TOKEN,
    # which no vocabulary holds, instead of a silent clamp to the last id. Device-side (no host
    # sync, CUDA-graph safe); the router refuses NO_TOKEN as a lane fault.
    total = cdf[:, -1]
    return torch.where(torch.isfinite(total) & (total > 0), idx, torch.full_like(idx, NO_TOKEN))


def accept_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor):
    """target_argmax [R, K+1], drafts [R, K] (padded), k [R] -> (accepted [R], final token [R])."""
    K = drafts.shape[1]
    valid = torch.arange(K, device=drafts.device)[None, :] < k[:, None]
    ok = (drafts == target_argmax[:, :K]) & valid
    accepted = ok.long().cumprod(-1).sum(-1)
    final = target_argmax.gather(1, accepted[:, None]).squeeze(1)
    return accepted, final


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor,
                   seeds: torch.Tensor, start_pos: torch.Tensor):
    """Lossless rejection sampling.

    p [R, K+1, V] target probs at the pending token and each draft; q [R, K, V] draft probs;
    drafts [R, K]; k [R]; start_pos [R] = position of the pending token, so draft i sits at
    start_pos + 1 + i. Returns (accepted [R], final token [R]).
    """
    R, K = drafts.shape
    if K > 0:
        pos = start_pos[:, None] + 1 + torch.arange(K, device=p.device)[None, :]
        u = uniforms(seeds[:, None].expand(R, K), pos, STREAM_ACCEPT)
        p_d = p[:, :K].gather(-1, drafts[..., None]).squeeze(-1)
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
        valid = torch.arange(K, device=p.device)[None, :] < k[:, None]
        ok = (u * q_d < p_d) & valid
        accepted = ok.long().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(R, dtype=torch.long, device=p.device)
    p_m = p[torch.arange(R, device=p.device), accepted]                  # [R, V]
    rejected = accepted < k
    if K > 0:
        q_m = q[torch.arange(R, device=p.device), accepted.clamp(max=K - 1)]
        residual = (p_m - q_m).clamp_(min=0)
        mass = residual.sum(-1, keepdim=True)
        # If p == q at that row the residual is empty; p itself is then the right distribution.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_m)
        dist = torch.where(rejected[:, None], residual, p_m)
    else:
        dist = p_m
    u_final = uniforms(seeds, start_pos + 1 + accepted, STREAM_TARGET)
    return accepted, sample(dist, u_final)


# How a batch picks its tokens; host-side knowledge, so device code needs no sync to branch.
GREEDY, SAMPLE, SAMPLE_TRUNCATED = "greedy", "sample", "sample_truncated"


def choice_mode(samplings) -> str:
    if all(s.greedy for s in samplings):
        return GREEDY
    truncates = any((s.top_k > 0 or s.top_p < 1) and not s.greedy for s in samplings)
    return SAMPLE_TRUNCATED if truncates else SAMPLE


def choose(logits: torch.Tensor, mode: str, temp, top_k, top_p, seeds, positions: torch.Tensor, stream: int):
    """One token per row with no host sync: (tokens [N], probs [N, V] float32 or None if greedy).
    `positions` are where the chosen tokens will sit (they key the counter-based uniforms)."""
    if mode == GREEDY:
        return logits.argmax(-1), None
    probs = probabilities(logits.float(), temp, top_k, top_p, truncate=mode == SAMPLE_TRUNCATED)
    return sample(probs, uniforms(seeds, positions, stream)), probs
