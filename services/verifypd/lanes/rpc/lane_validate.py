"""Validation at the lane edge: every lane message is checked against the lane's own limits before
any tensor is touched. Torch-free (works on the protobuf messages).

A bad field raises `LaneInvalid` naming it (`items[2].draft_kv.block_ids`), which the lane server
answers with INVALID_ARGUMENT; a handle for a pool or generation this lane does not hold (a
stale handle from before a lane restart) is FAILED_PRECONDITION. What passes here cannot make
the model code index out of range, so an exception past this point is a real fault (INTERNAL).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

import grpc

from verifypd.domain.requests import MAX_K, InvalidRequest, SamplingParams

MAX_ITEMS = 4096  # work items per lane call
MAX_BATCH_TOKENS = 1 << 17  # token positions computed per lane call
POOL_ID = re.compile(r"(target|draft)-[0-9a-f]{12}")
ADDR = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}")
MAX_SHORT_STR = 128  # ids, boot ids, device uuids
# cudaIpcMemHandle_t / cudaIpcEventHandle_t are 64 bytes; torch's share handles can carry more
# (e.g. a handle-type prefix with expandable segments), so only an upper bound is enforced.
CUDA_HANDLE_BYTES = 256


class LaneInvalid(ValueError):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PoolLimits:
    """What a handle may point at in one pool this lane holds."""

    pool_id: str
    generation: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class LaneLimits:
    vocab_size: int
    max_context: int
    pools: dict  # role -> PoolLimits


def _bad(field: str, why: str) -> LaneInvalid:
    return LaneInvalid(f"{field}: {why}")


def _tokens(field: str, ids, limits: LaneLimits, *, min_len: int = 0) -> None:
    if len(ids) < min_len:
        raise _bad(field, f"need at least {min_len} token(s), got {len(ids)}")
    # vocab_size 0: a pool-less draft lane (prompt lookup) loads no model and knows no vocabulary;
    # it only copies ids it was given, and the verify lane checks every id it scores.
    if ids and limits.vocab_size and max(ids) >= limits.vocab_size:
        raise _bad(field, f"token id {max(ids)} is outside the vocabulary [0, {limits.vocab_size})")


def check_sampling(field: str, s) -> None:
    params = SamplingParams(
        temperature=s.params.temperature, top_p=s.params.top_p or 1.0, top_k=s.params.top_k, seed=s.seed
    )
    try:
        params.validate()
    except InvalidRequest as exc:
        raise _bad(field, str(exc)) from None


def _handle(field: str, h, role: str, end: int, limits: LaneLimits) -> None:
    """The handle names a pool this lane holds, and its blocks cover positions [0, end)."""
    pool = limits.pools.get(role)
    if pool is None:
        raise LaneInvalid(
            f"{field}: this lane holds no {role} pool (call ImportPools first)", grpc.StatusCode.FAILED_PRECONDITION
        )
    if h.pool_id != pool.pool_id or h.generation != pool.generation:
        raise LaneInvalid(
            f"{field}: pool {h.pool_id!r} generation {h.generation} is not this lane's {role} pool "
            f"({pool.pool_id!r} generation {pool.generation}); a handle from before a lane restart?",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if end > limits.max_context:
        raise _bad(field, f"positions up to {end} exceed the lane's context of {limits.max_context}")
    blocks = h.block_ids
    if blocks and max(blocks) >= pool.num_blocks:
        raise _bad(f"{field}.block_ids", f"block {max(blocks)} is outside the pool [0, {pool.num_blocks})")
    if len(blocks) * pool.block_size < end:
        raise _bad(f"{field}.block_ids", f"{len(blocks)} blocks of {pool.block_size} cannot hold {end} positions")
    if len(blocks) > pool.num_blocks:
        raise _bad(f"{field}.block_ids", f"{len(blocks)} blocks, the pool has {pool.num_blocks}")


def _draft_handle(field: str, item, end: int, limits: LaneLimits) -> None:
    """draft_kv is unset exactly when the draft lane owns no pool (prompt lookup): then no lane
    holds a draft pool; a lane that does hold one needs the handle."""
    if item.HasField("draft_kv"):
        _handle(field, item.draft_kv, "draft", end, limits)
    elif "draft" in limits.pools:
        raise _bad(field, "missing: this lane holds a draft pool")


def _batch(items, tokens_of) -> None:
    if len(items) > MAX_ITEMS:
        raise _bad("items", f"{len(items)} items in one call; at most {MAX_ITEMS}")
    total = sum(tokens_of(i) for i in items)
    if total > MAX_BATCH_TOKENS:
        raise _bad("items", f"{total} token positions in one call; at most {MAX_BATCH_TOKENS}")


def check_prefill(batch, limits: LaneLimits) -> None:
    _batch(batch.items, lambda i: len(i.token_ids))
    for n, i in enumerate(batch.items):
        f = f"items[{n}]"
        _tokens(f"{f}.token_ids", i.token_ids, limits, min_len=1)
        end = i.start_pos + len(i.token_ids)
        _handle(f"{f}.target_kv", i.target_kv, "target", end, limits)
        _draft_handle(f"{f}.draft_kv", i, end, limits)
        check_sampling(f"{f}.sampling", i.sampling)


def check_draft(batch, limits: LaneLimits) -> None:
    _batch(batch.items, lambda i: len(i.input_tokens) + i.k)
    for n, i in enumerate(batch.items):
        f = f"items[{n}]"
        if not 1 <= i.k <= MAX_K:
            raise _bad(f"{f}.k", f"must be in [1, {MAX_K}], got {i.k}")
        _tokens(f"{f}.input_tokens", i.input_tokens, limits, min_len=1)
        # Writes the inputs' KV and that of the first k - 1 drafts.
        _draft_handle(f"{f}.draft_kv", i, i.start_pos + len(i.input_tokens) + i.k - 1, limits)
        check_sampling(f"{f}.sampling", i.sampling)


def check_verify(batch, limits: LaneLimits) -> None:
    _batch(batch.items, lambda i: 1 + len(i.draft_tokens))
    for n, i in enumerate(batch.items):
        f = f"items[{n}]"
        k = len(i.draft_tokens)
        if k > MAX_K:
            raise _bad(f"{f}.draft_tokens", f"{k} drafts; at most {MAX_K}")
        _tokens(f"{f}.pending_token", [i.pending_token], limits)
        _tokens(f"{f}.draft_tokens", i.draft_tokens, limits)
        _handle(f"{f}.target_kv", i.target_kv, "target", i.start_pos + 1 + k, limits)
        check_sampling(f"{f}.sampling", i.sampling)
        if i.draft_probs.rows or i.draft_probs.ByteSize():
            check_probs(f"{f}.draft_probs", i.draft_probs, k, limits.vocab_size)


def check_probs(field: str, d, rows: int, vocab: int) -> None:
    import numpy as np

    if d.rows != rows:
        raise _bad(f"{field}.rows", f"{d.rows} rows for {rows} draft tokens")
    if d.vocab_size != vocab:
        raise _bad(f"{field}.vocab_size", f"{d.vocab_size}, the lane's vocabulary is {vocab}")
    if d.sparse_width:
        if d.dense_f32 or not 1 <= d.sparse_width <= vocab:
            raise _bad(f"{field}.sparse_width", f"must be in [1, {vocab}] and exclusive with dense_f32")
        need = rows * d.sparse_width * 4
        for name in ("sparse_ids_u32", "sparse_probs_f32"):
            if len(getattr(d, name)) != need:
                raise _bad(f"{field}.{name}", f"{len(getattr(d, name))} bytes, expected {need}")
        ids = np.frombuffer(d.sparse_ids_u32, dtype="<u4")
        if ids.size and int(ids.max()) >= vocab:
            raise _bad(f"{field}.sparse_ids_u32", f"token id {int(ids.max())} is outside [0, {vocab})")
        values = np.frombuffer(d.sparse_probs_f32, dtype="<f4")
    else:
        if len(d.dense_f32) != rows * vocab * 4:
            raise _bad(f"{field}.dense_f32", f"{len(d.dense_f32)} bytes, expected {rows * vocab * 4}")
        values = np.frombuffer(d.dense_f32, dtype="<f4")
    if values.size and not (np.isfinite(values).all() and (values >= 0).all()):
        raise _bad(field, "probabilities must be finite and >= 0")


# -- ImportPools -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolSpec:
    """What this lane expects of a pool of one role: its own model's shape and its own limits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    itemsize: int
    max_blocks: int


def check_pool_descriptor(field: str, d, role: str, spec: PoolSpec, layout: str, shm_dir: str) -> None:
    if not POOL_ID.fullmatch(d.pool_id) or not d.pool_id.startswith(role + "-"):
        raise _bad(f"{field}.pool_id", f"{d.pool_id[:64]!r} is not a {role} pool id ({role}-<12 hex>)")
    if d.layout != layout:
        raise _bad(f"{field}.layout", f"{d.layout[:64]!r}; this lane reads {layout!r}")
    if d.dtype != spec.dtype:
        raise _bad(f"{field}.dtype", f"{d.dtype[:32]!r}; this lane's KV is {spec.dtype} (--kv-cache-dtype)")
    for name, want in (
        ("num_layers", spec.num_layers),
        ("num_kv_heads", spec.num_kv_heads),
        ("head_dim", spec.head_dim),
        ("block_size", spec.block_size),
    ):
        if getattr(d, name) != want:
            raise _bad(f"{field}.{name}", f"{getattr(d, name)}; this lane's {role} model needs {want}")
    if not 1 <= d.num_blocks <= spec.max_blocks:
        raise _bad(f"{field}.num_blocks", f"{d.num_blocks}; must be in [1, {spec.max_blocks}] (this lane's limit)")
    for name in ("host_boot_id", "device_uuid"):
        if len(getattr(d, name)) > MAX_SHORT_STR:
            raise _bad(f"{field}.{name}", f"longer than {MAX_SHORT_STR} characters")
    if d.kv_transfer_addr and not ADDR.fullmatch(d.kv_transfer_addr):
        raise _bad(f"{field}.kv_transfer_addr", "must be HOST:PORT")
    nbytes = 2 * d.num_layers * d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim * spec.itemsize
    share = d.WhichOneof("share")
    if share == "shm_path":
        _check_shm_path(f"{field}.shm_path", d.shm_path, d.pool_id, nbytes, shm_dir)
    elif share == "cuda_ipc":
        c = d.cuda_ipc
        if c.storage_size_bytes != nbytes:
            raise _bad(f"{field}.cuda_ipc.storage_size_bytes", f"{c.storage_size_bytes}, the geometry needs {nbytes}")
        for name in ("mem_handle", "event_handle"):
            if len(getattr(c, name)) > CUDA_HANDLE_BYTES:
                raise _bad(f"{field}.cuda_ipc.{name}", f"longer than {CUDA_HANDLE_BYTES} bytes")
        if len(c.ref_counter_handle) > 256:
            raise _bad(f"{field}.cuda_ipc.ref_counter_handle", "longer than 256 bytes")


def _check_shm_path(field: str, path: str, pool_id: str, nbytes: int, shm_dir: str) -> None:
    """Only a file the owner created for this very pool: `<shm_dir>/verifypd-<pool_id>`, a regular
    file (no symlink), of exactly the pool's size. Never an arbitrary path."""
    expected = os.path.join(shm_dir, f"verifypd-{pool_id}")
    if path != expected:
        raise _bad(field, f"must be {expected} for pool {pool_id}")
    try:
        st = os.lstat(path)
    except OSError:
        raise LaneInvalid(f"{field}: {path} does not exist", grpc.StatusCode.FAILED_PRECONDITION) from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(field, f"{path} is not a regular file")
    if st.st_size != nbytes:
        raise _bad(field, f"{path} holds {st.st_size} bytes, the geometry needs {nbytes}")
