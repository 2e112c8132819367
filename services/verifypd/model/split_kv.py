"""How many parts split-KV attention cuts each program's keys into (kernels/paged_attention.py `splits`).
Torch- and Triton-free: the runner picks it on the host, per CUDA graph (the parts are cut on the device).

One sequence's long context otherwise runs on a few SMs, each program walking every key of its kv head
for its tile of query rows: Llama-2-7B's 32 heads at batch 1 are 32 programs on an H200's 132 SMs,
SmolLM2-135M's 3 kv heads 3 to 6. A cached prompt's short suffix attends over its whole prefix that way.
"""

from __future__ import annotations

# A prefill chunk takes the split kernel from this many cached positions before it: below, one
# program's walk over the keys is short and the combine's extra launch a layer would not pay.
SPLIT_MIN_CONTEXT = 512
MOST_SPLITS = 16
# A decode or verify step of few sequences takes it (a captured variant of its graph) from this many
# positions in its longest sequence: below, each program walks at most a few key tiles and the
# combine's launch would cost about what the split saves (bench/engine/decode_splits.py).
DECODE_SPLIT_MIN_CONTEXT = 256


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attention_programs(num_seqs: int, num_kv_heads: int, group: int, max_query: int) -> int:
    """The paged-attention grid's program count without splits (its tile_rows rule: 16..64 rows)."""
    rows = max_query * group
    tile = min(64, max(16, next_power_of_2(rows)))
    return num_seqs * num_kv_heads * -(-rows // tile)


def kv_splits(programs: int, sm_count: int, most: int = MOST_SPLITS) -> int:
    """Parts per program (a power of two, 1..`most`) so that `programs` x parts fill about twice
    `sm_count` SMs; 1 when `programs` alone fill them."""
    if programs >= sm_count:
        return 1
    want = -(-2 * sm_count // max(programs, 1))
    return min(most, next_power_of_2(max(want, 1)))
