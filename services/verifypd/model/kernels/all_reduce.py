"""One-shot and two-shot all-reduce over peer-mapped buffers (Triton), one launch, no host sync.

Every rank owns one buffer that every other rank has mapped (CUDA IPC on GPUs; shared memory in the
CPU tests, where two processes run this kernel under Triton's interpreter). `bases[p]` is rank p's
buffer as mapped in *this* process. A buffer's layout, in bytes:

    [0, sig_bytes)                        signal words: int64 [G, WPAD]; word (b, p) is written by
                                          rank p's program b, read (polled) by the owner's program b
    [sig_bytes + q * data_bytes, +data)   data slot of parity q (q = 0, 1), the tensor's elements

Ownership (the invariant the protocol rests on): element i belongs to program b(i) = (i // BLOCK) % G
on every rank and in every call, G fixed for a buffer's life. Program b therefore only ever waits
for the programs b of the other ranks, and `state` [G, 2] int64 (this rank's, not shared) holds
program b's count of signal rounds and of calls, the same on every rank since the ranks run the
same calls.

One-shot (a call):  copy the tensor into my slot -> signal round r -> wait until every rank's
word (b, p) >= r -> sum the W slots in rank order 0..W-1 (float32) into the tensor. Every rank sums
the same values in the same order, so all ranks end bitwise equal.
Two-shot: copy in -> round r -> chunk c is reduced by rank (c // G) % W only, which writes the
sum to its own slot and the tensor -> round r + 1 -> every other chunk is copied from its owner's slot.

Why no barrier at the end: the slots alternate by call parity. My program b writes slot q again at
call n + 2; a peer's program b read my slot q during call n; at call n + 1 my program b waited for
the peer's program b of call n + 1, which starts only after the peer's call n kernel has finished
(kernels on one stream do not overlap). Signals are monotonic counts (>= tests), so a peer that is
one round ahead is harmless. Signal stores are release and polls acquire at system scope: the
block-wide barrier before the signal orders every thread's stores before it (the pattern of vLLM's
custom all-reduce); plain loads and stores otherwise. No multicast / multimem instruction anywhere.

Progress needs all G programs of a rank to run eventually while peers spin: G is small (<= SMs / 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _signal_and_wait(bases, is_peer, my_sig, pid, rank, value, WPAD: tl.constexpr):
    """Tells every rank that this rank's program `pid` reached round `value`, then waits until every
    rank's program `pid` has. `bases` int64 [WPAD]: the buffers as mapped here (signals at offset 0)."""
    tl.debug_barrier()  # every thread's stores of this program precede the signal
    to_peers = bases.to(tl.pointer_type(tl.int64)) + pid * WPAD + rank
    tl.atomic_xchg(to_peers, tl.zeros([WPAD], tl.int64) + value, mask=is_peer, sem="release", scope="sys")
    words = my_sig + pid * WPAD + tl.arange(0, WPAD)
    seen = tl.atomic_add(words, tl.zeros([WPAD], tl.int64), mask=is_peer, sem="acquire", scope="sys")
    while tl.min(tl.where(is_peer, seen, value)) < value:
        seen = tl.atomic_add(words, tl.zeros([WPAD], tl.int64), mask=is_peer, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads a peer's slot before the wait is over


@triton.jit(do_not_specialize=["n", "rank"])
def _all_reduce_kernel(
    data_ptr,  # the tensor [n], reduced in place
    n,
    bases_ptr,  # int64 [WORLD]: each rank's buffer address in this process
    state_ptr,  # int64 [G, 2]: per program (signal rounds, calls)
    rank,
    sig_bytes,
    data_bytes,
    WORLD: tl.constexpr,
    WPAD: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO_SHOT: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rounds = tl.load(state_ptr + 2 * pid)
    calls = tl.load(state_ptr + 2 * pid + 1)
    slot = sig_bytes + (calls % 2) * data_bytes  # byte offset of this call's data slot
    elem = data_ptr.dtype.element_ty
    ranks = tl.arange(0, WPAD)
    is_peer = ranks < WORLD
    bases = tl.load(bases_ptr + ranks, mask=is_peer, other=0)
    my_base = tl.load(bases_ptr + rank)
    my_sig = my_base.to(tl.pointer_type(tl.int64))
    my_slot = (my_base + slot).to(tl.pointer_type(elem))
    chunks = tl.cdiv(n, BLOCK)
    lanes = tl.arange(0, BLOCK)

    for c in range(pid, chunks, G):  # copy in
        offs = c * BLOCK + lanes
        ok = offs < n
        tl.store(my_slot + offs, tl.load(data_ptr + offs, mask=ok), mask=ok)
    rounds += 1
    _signal_and_wait(bases, is_peer, my_sig, pid, rank, rounds, WPAD)

    for c in range(pid, chunks, G):  # reduce (two-shot: only the chunks this rank owns)
        if (not TWO_SHOT) or (c // G) % WORLD == rank:
            offs = c * BLOCK + lanes
            ok = offs < n
            acc = tl.zeros([BLOCK], tl.float32)
            for p in tl.static_range(WORLD):
                src = (tl.load(bases_ptr + p) + slot).to(tl.pointer_type(elem))
                acc += tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
            total = acc.to(elem)
            tl.store(data_ptr + offs, total, mask=ok)
            if TWO_SHOT:
                tl.store(my_slot + offs, total, mask=ok)

    if TWO_SHOT:
        rounds += 1
        _signal_and_wait(bases, is_peer, my_sig, pid, rank, rounds, WPAD)
        for c in range(pid, chunks, G):  # gather the other owners' sums
            owner = (c // G) % WORLD
            if owner != rank:
                offs = c * BLOCK + lanes
                ok = offs < n
                src = (tl.load(bases_ptr + owner) + slot).to(tl.pointer_type(elem))
                tl.store(data_ptr + offs, tl.load(src + offs, mask=ok), mask=ok)

    tl.store(state_ptr + 2 * pid, rounds)
    tl.store(state_ptr + 2 * pid + 1, calls + 1)


def all_reduce_in_place(
    data: torch.Tensor,
    bases: torch.Tensor,
    state: torch.Tensor,
    rank: int,
    world: int,
    sig_bytes: int,
    data_bytes: int,
    two_shot: bool,
    block: int,
) -> None:
    """Sums contiguous `data` over the ranks in place (every rank calls it with the same size, in the
    same order). `state` [G, 2] int64 fixes the program count G (see the module doc)."""
    programs = state.shape[0]
    _all_reduce_kernel[(programs,)](
        data,
        data.numel(),
        bases,
        state,
        rank,
        sig_bytes,
        data_bytes,
        WORLD=world,
        WPAD=triton.next_power_of_2(world),
        BLOCK=block,
        TWO_SHOT=two_shot,
        num_warps=8,
    )
