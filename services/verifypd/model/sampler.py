"""Token choice and lossless speculative acceptance, vectorized over a batch.

A seed names one output. The token at output position t of a sampled request is

    token_t = argmax_v  log(U[seed, t, v]) / p_t(v)           (an exponential race: Gumbel-max)

with p_t the target's processed distribution at t (temperature, top-k, top-p) and U uniforms in
(0, 1) that are a counter-based hash of (seed, t, v): the same on every device, in every batch, in
every process. Since the U of position t are independent of everything before t, token_t ~ p_t:
plain sampling, with the randomness fixed by (seed, t).

Speculation (coupled, or "Gumbel", speculative sampling): a draft proposes its own race winner
with the *same* U and its distribution q_t, and the target keeps a draft token iff it equals
token_t; at the first mismatch it emits token_t; if all k are kept it emits token_{t+k+1} as the
bonus. That is exactly the greedy acceptance rule with argmax replaced by the race, so the output
is token_t at every t: identical to decoding without a draft, whatever the draft, k, batch,
schedule, preemption or topology. Lossless by construction (the emitted tokens are plain samples);
the draft only changes how many positions one verify step settles. A draft token is kept with
probability P(race winners of p and q agree) >= (1 - TV) / (1 + TV), TV = total variation(p, q)
(the optimum for choices made without seeing each other's distribution; classical rejection
sampling keeps 1 - TV but its output depends on q). For a deterministic draft (n-gram, greedy
draft) q is one-hot and both rules keep the token with probability p(token). docs/engine.md, "Seeds".

Greedy requests are the special case p = one-hot(argmax), handled by a fast path. `uniforms` (one
per (seed, position, stream)) remains for the simulated-acceptance benchmark lane.
"""

from __future__ import annotations

import torch

from verifypd.domain.requests import GREEDY_BELOW

STREAM_ACCEPT = 1  # the simulated-acceptance benchmark's Bernoulli draws
NO_TOKEN = -1  # a row whose distribution is NaN or empty
_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9
RACE_CHUNK_ELEMENTS = 1 << 25  # rows x vocab per chunk of `race` (256 MiB per int64 temporary)

# (temperature, top_k, top_p, seeds) of a batch (params_tensor), as `choose` takes them after `mode`.
SamplingTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# What `choose` takes: the sampling tensors, or NO_PARAMS in greedy mode (which reads none).
ChoiceParams = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
NO_PARAMS: ChoiceParams = (None, None, None, None)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) in int64 arithmetic that never overflows."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position); int64 inputs (seeds as uint64 bit patterns)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _mix32(_mix32(_mix32(lo) ^ hi) ^ positions)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform floats in (0, 1), one per (seed, position); same on every device. Inputs int64."""
    x = _mix32(_keys(seeds, positions) ^ (stream * _GOLDEN32 & _MASK32))
    return ((x.double() + 0.5) / 4294967296.0).float()


def race_log_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """log U[seed, position, v] for v < vocab: [N, vocab] float32, all < 0. Integer ops only, so
    bit-identical on CPU and GPU, no host sync (CUDA-graph safe). U has 24 random bits (exact in
    float32, in (0, 1) strictly: log U is finite and negative, never 0).

    Cost is per element of [N, vocab], so the fully mixed parts are per row (the (seed, position)
    key) and per token (its own hash, [vocab]); each element only xors the two and takes one
    multiply round, whose top 24 bits (the best mixed) make U."""
    vocab_hash = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.long) * _GOLDEN32 + 0x632BE5AB)
    x = _keys(seeds, positions)[:, None] ^ vocab_hash[None, :]
    # In place: each [N, vocab] temporary costs a pass over memory (and on the CPU, fresh pages).
    x ^= x >> 16
    x *= 0x45D9F3B  # < 2^32 * 2^27: no int64 overflow
    x &= _MASK32
    x >>= 8
    return x.float().add_(0.5).mul_(1.0 / 16777216.0).log_()


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The seeded choice: probs [N, V], seeds [N] (int64 bit patterns), positions [N] of the tokens
    chosen -> token ids [N]. argmax_v log U_v / p_v is argmin_v E_v / p_v with E_v = -log U_v ~ Exp(1):
    token v wins with probability p_v; p_v = 0 scores -inf and never wins. Rows whose distribution
    is broken (NaN/inf, or no mass) give NO_TOKEN, which no vocabulary holds: device-side, no host
    sync; the router refuses NO_TOKEN as a lane fault. Rows go in chunks of RACE_CHUNK_ELEMENTS
    (the hash's int64 temporaries are [rows, V]: a 256-request verify of k = 8 over a 128k
    vocabulary would otherwise hold several GB of them)."""
    rows = max(1, RACE_CHUNK_ELEMENTS // probs.shape[-1])
    if probs.shape[0] <= rows:
        return _race(probs, seeds, positions)
    return torch.cat(
        [
            _race(probs[i : i + rows], seeds[i : i + rows], positions[i : i + rows])
            for i in range(0, probs.shape[0], rows)
        ]
    )


def _race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    scores = race_log_uniforms(seeds, positions, probs.shape[-1]).div_(probs)
    idx = scores.argmax(-1)
    total = probs.sum(-1)
    return torch.where(torch.isfinite(total) & (total > 0), idx, torch.full_like(idx, NO_TOKEN))


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


def params_tensor(samplings, device) -> SamplingTensors:
    """(temperature, top_k, top_p, seeds) of a batch's SamplingParams, on `device`."""
    temp = small_tensor([s.temperature for s in samplings], device, torch.float32)
    top_k = small_tensor([s.top_k for s in samplings], device)
    top_p = small_tensor([s.top_p for s in samplings], device, torch.float32)
    return temp, top_k, top_p, seed_tensor([s.seed for s in samplings], device)


def seed_tensor(seeds: list[int], device) -> torch.Tensor:
    """uint64 seeds as int64 bit patterns."""
    return small_tensor([s - (1 << 64) if s >= (1 << 63) else s for s in seeds], device)


def probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    truncate: bool | None = None,
) -> torch.Tensor:
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


def accept_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor):
    """target_argmax [R, K+1], drafts [R, K] (padded), k [R] -> (accepted [R], final token [R])."""
    K = drafts.shape[1]
    valid = torch.arange(K, device=drafts.device)[None, :] < k[:, None]
    ok = (drafts == target_argmax[:, :K]) & valid
    accepted = ok.long().cumprod(-1).sum(-1)
    final = target_argmax.gather(1, accepted[:, None]).squeeze(1)
    return accepted, final


def accept_raced(p: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor, seeds: torch.Tensor, start_pos: torch.Tensor):
    """Coupled speculative sampling (module doc): the greedy rule over the target's race winners.

    p [R, K+1, V] target probs at the pending token and each draft; drafts [R, K]; k [R];
    start_pos [R] = position of the pending token, so p[:, i] chooses position start_pos + 1 + i.
    Returns (accepted [R], final token [R]). Needs no draft probabilities.
    """
    R, K1, V = p.shape
    positions = start_pos[:, None] + 1 + torch.arange(K1, device=p.device)[None, :]
    winners = race(p.reshape(R * K1, V), seeds.repeat_interleave(K1), positions.reshape(-1)).view(R, K1)
    return accept_greedy(winners, drafts, k)


# How a batch picks its tokens; host-side knowledge, so device code needs no sync to branch.
GREEDY, SAMPLE, SAMPLE_TRUNCATED = "greedy", "sample", "sample_truncated"


def choice_mode(samplings) -> str:
    if all(s.greedy for s in samplings):
        return GREEDY
    truncates = any((s.top_k > 0 or s.top_p < 1) and not s.greedy for s in samplings)
    return SAMPLE_TRUNCATED if truncates else SAMPLE


def choose(
    logits: torch.Tensor,
    mode: str,
    temp: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row with no host sync: tokens [N]. `positions` are where the chosen tokens will
    sit: with the seeds they fix the race (module doc), so a draft and the target choosing for the
    same position share their randomness. The sampling tensors and `positions` may be None in GREEDY
    mode only (a caller building them from host lists may skip that copy)."""
    if mode == GREEDY:
        return logits.argmax(-1)
    if temp is None or top_k is None or top_p is None or seeds is None or positions is None:
        raise ValueError(
            f"choose in mode {mode!r} needs temperature, top_k, top_p, seeds and positions tensors, got None"
        )
    probs = probabilities(logits.float(), temp, top_k, top_p, truncate=mode == SAMPLE_TRUNCATED)
    return race(probs, seeds, positions)
