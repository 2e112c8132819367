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
def _signal_and_wait(bases_ptr, my_sig, pid, rank, value, WORLD: tl.constexpr, WPAD: tl.constexpr):
    """Tells every rank that this rank's program `pid` reached round `value`, then waits until every
    rank's program `pid` has. Scalar atomics: one thread each, the block barriers order the rest."""
    tl.debug_barrier()  # every thread's stores of this program precede the signal
    for p in tl.static_range(WORLD):
        word = tl.load(bases_ptr + p).to(tl.pointer_type(tl.int64)) + pid * WPAD + rank
        tl.atomic_xchg(word, value, sem="release", scope="sys")
    for p in tl.static_range(WORLD):
        word = my_sig + pid * WPAD + p
        while tl.atomic_add(word, 0, sem="acquire", scope="sys") < value:
            pass
    tl.debug_barrier()  # no thread reads a peer's slot before the wait is over


@triton.jit
def _slot_of(bases_ptr, p, slot, elem: tl.constexpr):
    """Rank p's data slot (byte offset `slot` into its buffer) as a pointer to `elem`; the buffers and
    slots are 256-byte aligned (lets the loads and stores be 16-byte vectors)."""
    return tl.multiple_of((tl.load(bases_ptr + p) + slot).to(tl.pointer_type(elem)), 16)


@triton.jit
def _reduce_chunk(data_ptr, my_slot, bases_ptr, slot, offs, n, WORLD: tl.constexpr, KEEP: tl.constexpr):
    """data[offs] = the sum of every rank's slot at offs, in rank order (float32, one rounding);
    KEEP: also into this rank's slot, where the peers gather it from (two-shot)."""
    ok = offs < n
    elem = data_ptr.dtype.element_ty
    acc = tl.zeros(offs.shape, tl.float32)
    for p in tl.static_range(WORLD):
        src = _slot_of(bases_ptr, p, slot, elem)
        acc += tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    total = acc.to(elem)
    tl.store(data_ptr + offs, total, mask=ok)
    if KEEP:
        tl.store(my_slot + offs, total, mask=ok)


@triton.jit(do_not_specialize=["rank"])  # n: its divisibility by 16 lets loads vectorize
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
    my_base = tl.load(bases_ptr + rank)
    my_sig = my_base.to(tl.pointer_type(tl.int64))
    my_slot = _slot_of(bases_ptr, rank, slot, elem)
    chunks = tl.cdiv(n, BLOCK)
    lanes = tl.arange(0, BLOCK)

    for c in range(pid, chunks, G):  # copy in
        offs = c * BLOCK + lanes
        ok = offs < n
        tl.store(my_slot + offs, tl.load(data_ptr + offs, mask=ok), mask=ok)
    rounds += 1
    _signal_and_wait(bases_ptr, my_sig, pid, rank, rounds, WORLD, WPAD)

    for c in range(pid, chunks, G):  # reduce (two-shot: only the chunks this rank owns)
        if TWO_SHOT:
            if (c // G) % WORLD == rank:
                _reduce_chunk(data_ptr, my_slot, bases_ptr, slot, c * BLOCK + lanes, n, WORLD, True)
        else:
            _reduce_chunk(data_ptr, my_slot, bases_ptr, slot, c * BLOCK + lanes, n, WORLD, False)

    if TWO_SHOT:
        rounds += 1
        _signal_and_wait(bases_ptr, my_sig, pid, rank, rounds, WORLD, WPAD)
        for c in range(pid, chunks, G):  # gather the other owners' sums
            owner = (c // G) % WORLD
            if owner != rank:
                offs = c * BLOCK + lanes
                ok = offs < n
                src = _slot_of(bases_ptr, owner, slot, elem)
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
