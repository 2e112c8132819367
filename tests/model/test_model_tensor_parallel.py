"""Tensor parallelism on CPU: two ranks over a gloo process group run the sharded tiny
Llama / Qwen2 (model.tensor_parallel) and must give the unsharded model's logits (float32, tight
tolerance) for a ragged prefill, a paged decode step and a multi-token verify step, and the same
greedy tokens over 16 decode steps. Each rank's KV pool holds only its kv heads; the block ids are
the same on both ranks and in the single-rank run."""

from __future__ import annotations

import pathlib

import pytest
import torch
from engine_helpers import write_tiny_llama
from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.slow  # tensor-parallel ranks as processes (gloo) (tests/README.md)

WORLD = 2
BLOCK_SIZE = 4
DECODE_STEPS = 16
PROMPTS = ([5, 17, 9, 33, 41, 8, 12], [3, 70, 22, 22, 61, 14, 90, 7, 45, 30, 11])
# Disjoint blocks per sequence: 8 blocks of 4 hold 32 positions (prompt + 16 decodes + 3 verify).
BLOCKS = (tuple(range(0, 8)), tuple(range(8, 16)))


def run_model(model_dir: str, group) -> dict:
    """Prefill both prompts, 16 greedy paged decode steps, then score 3 tokens at once (a verify).
    Returns the logits of each phase and the greedy tokens."""
    from verifypd.model.kv_pool import KvPool, PoolGeometry
    from verifypd.model.layout import TokenRun
    from verifypd.model.loader import load_model
    from verifypd.model.runner import ModelRunner
    from verifypd.model.tensor_parallel import shard_model

    loaded = load_model(model_dir, torch.device("cpu"), torch.float32)
    model = shard_model(loaded.shape, loaded.weights, group, attention="reference")
    s = model.shape
    pool = KvPool(
        "target",
        PoolGeometry(s.num_layers, 16, BLOCK_SIZE, s.num_kv_heads, s.head_dim),
        torch.float32,
        torch.device("cpu"),
    )
    runner = ModelRunner(model, pool, graphs=False)
    prefill = runner.forward([TokenRun(list(p), 0, b) for p, b in zip(PROMPTS, BLOCKS)], "all")
    last = prefill[torch.tensor([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1])]
    tokens, decode_logits = [last.argmax(-1).tolist()], []
    positions = [len(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        logits = runner.last_logits([TokenRun([t], pos, b) for t, pos, b in zip(tokens[-1], positions, BLOCKS)])
        decode_logits.append(logits)
        tokens.append(logits.argmax(-1).tolist())
        positions = [p + 1 for p in positions]
    verify = runner.score([TokenRun([t, 4, 50], pos, b) for t, pos, b in zip(tokens[-1], positions, BLOCKS)])
    return dict(
        prefill=prefill,
        decode=torch.stack(decode_logits),
        verify=verify,
        tokens=tokens,
        pool_shape=tuple(pool.tensor.shape),
        tp_group=model.tp_group is not None,
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("tp")
    return [
        str(write_tiny_llama(root / "llama", seed=3, layers=2, heads=4, kv_heads=2)),
        str(write_tiny_llama(root / "qwen2", seed=4, layers=2, heads=4, kv_heads=2, model_type="qwen2")),
    ]


def test_tp2_over_gloo_equals_tp1(model_dirs, tmp_path):
    from verifypd.model.tensor_parallel import SingleRank

    ranks = run_on_ranks(run_model, model_dirs, tmp_path, WORLD)
    for model_dir in model_dirs:
        single = run_model(model_dir, SingleRank())
        assert not single["tp_group"] and single["pool_shape"][4] == 2  # world 1: today's model, all kv heads
        for rank, result in enumerate(r[model_dir] for r in ranks):
            where = f"{pathlib.Path(model_dir).name} rank {rank}"
            assert result["tp_group"] and result["pool_shape"][4] == 1, where  # half the kv heads per rank
            for phase in ("prefill", "decode", "verify"):
                torch.testing.assert_close(
                    result[phase],
                    single[phase],
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, phase=phase, where=where: f"{where} {phase}: {m}",
                )
            assert result["tokens"] == single["tokens"], where


def test_shard_shape_needs_divisible_heads():
    from verifypd.model.loader import random_shape
    from verifypd.model.tensor_parallel import shard_shape

    shape = random_shape("llama-2-70b", None)[0]
    local = shard_shape(shape, 8)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 1, 3584)
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (8192, 128, 32000)
    with pytest.raises(ValueError, match=r"tensor parallel size 16 must divide num_kv_heads \(8\)"):
        shard_shape(shape, 16)
    with pytest.raises(ValueError, match="must be >= 1"):
        shard_shape(shape, 0)


def test_shards_partition_the_weights(monkeypatch):
    """Every row of qkv / gate_up and every column of o / down lands on exactly one rank."""
    from verifypd.model.loader import RANDOM_SHAPES, random_model
    from verifypd.model.tensor_parallel import shard_weights

    monkeypatch.setitem(
        RANDOM_SHAPES,
        "tiny-tp",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            vocab_size=40,
            qkv_bias=True,
        ),
    )
    loaded = random_model("tiny-tp", torch.device("cpu"), torch.float32, 64)
    full = loaded.weights.layers[0]
    shards = [shard_weights(loaded.shape, loaded.weights, r, 2).layers[0] for r in range(2)]
    # qkv rows: q [0, 32), k [32, 48), v [48, 64) with head_dim 8; rank r: q heads 2r..2r+1, kv head r.
    for r, shard in enumerate(shards):
        expect = torch.cat(
            [full.qkv[16 * r : 16 * r + 16], full.qkv[32 + 8 * r : 40 + 8 * r], full.qkv[48 + 8 * r : 56 + 8 * r]]
        )
        assert torch.equal(shard.qkv, expect)
        assert torch.equal(
            shard.qkv_bias,
            torch.cat(
                [
                    full.qkv_bias[16 * r : 16 * r + 16],
                    full.qkv_bias[32 + 8 * r : 40 + 8 * r],
                    full.qkv_bias[48 + 8 * r : 56 + 8 * r],
                ]
            ),
        )
        assert torch.equal(
            shard.gate_up, torch.cat([full.gate_up[24 * r : 24 * r + 24], full.gate_up[48 + 24 * r : 72 + 24 * r]])
        )
    assert torch.equal(torch.cat([s.o for s in shards], 1), full.o)
    assert torch.equal(torch.cat([s.down for s in shards], 1), full.down)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        shard_weights(loaded.shape, loaded.weights, 2, 2)
