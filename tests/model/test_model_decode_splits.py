"""Decode and verify steps of few sequences over long contexts replay the split-KV variant of their
graph (GraphRunner.key, model.split_kv): the logits equal the torch reference forward's over the same
pool (fp32), for "last" (decode, a draft's first step), "all" (verify) and "accept" (greedy verify)
graphs; a short context keeps the plain graphs, and so does every call with the variants switched
off (split_min_context None). On the CPU the graphs' functions run over their
static buffers (graphs="eager") and the Triton kernels under TRITON_INTERPRET=1 (conftest.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from engine_helpers import DEVICE, VOCAB, write_tiny_llama

from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model
from verifypd.model.runner import ModelRunner

pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

BLOCK, NUM_BLOCKS, LONG = 4, 120, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("splits") / "m", seed=5, layers=2))


def runner_for(model_dir: str, attention: str) -> ModelRunner:
    loaded = load_model(model_dir, torch.device(DEVICE), torch.float32)
    s = loaded.shape
    geometry = PoolGeometry(s.num_layers, NUM_BLOCKS, BLOCK, s.num_kv_heads, s.head_dim)
    pool = KvPool("target", geometry, torch.float32, torch.device(DEVICE))
    runner = ModelRunner(
        PagedLlama(s, loaded.weights, attention=attention), pool, graphs="eager" if attention == "triton" else False
    )
    if runner.graphs is not None:
        runner.graphs.split_min_context = LONG  # the tiny contexts' "long"
    return runner


def prefilled(model_dir: str, attention: str, prompts: list[list[int]], tables: list[tuple[int, ...]]):
    runner = runner_for(model_dir, attention)
    runner.forward([TokenRun(p, 0, t) for p, t in zip(prompts, tables)], None)
    return runner


@pytest.mark.parametrize(
    ("lengths", "min_context", "split"), [((150, 201), LONG, True), ((3, 6), LONG, False), ((150, 201), None, False)]
)
def test_split_graphs_equal_the_reference(model_dir, lengths, min_context, split):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    # Contexts past two 64-key tiles: each split gets keys of its own.
    tables = [tuple(range(0, 60)), tuple(range(60, 120))]
    ref = prefilled(model_dir, "reference", prompts, tables)
    got = prefilled(model_dir, "triton", prompts, tables)
    assert got.graphs is not None
    got.graphs.split_min_context = min_context  # None: no split variants
    drafts = [[rng.randrange(3, VOCAB) for _ in range(3)] for _ in prompts]
    runs = [TokenRun([p[-1]], len(p), t) for p, t in zip(prompts, tables)]  # a decode step
    verify = [TokenRun([p[-1], *d], len(p), t) for p, d, t in zip(prompts, drafts, tables)]  # k = 3
    for name, call in (
        ("last", lambda r: r.last_logits(runs)[: len(runs)]),
        ("all", lambda r: r.score(verify)),
        ("accept", lambda r: r.verify_greedy(verify, [3, 3]).float()),
    ):
        want, have = call(ref), call(got)
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4, msg=name)
    keys = got.graphs.captured
    assert {k[0] for k in keys if len(k) == 4} == ({"last", "all", "accept"} if split else set()), keys
    assert all(k[3] > 1 for k in keys if len(k) == 4)


def test_shorter_sequences_in_a_split_graph_equal_the_plain_graph_exactly(model_dir):
    """Inside a split variant a sequence below split_min_context is not cut: a batch whose host-side
    lengths chose the variant early computes exactly what the plain graphs do (fp32, bit for bit),
    though its contexts (150, 170) span more than two key tiles a real split would cut."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (150, 170)]
    tables = [tuple(range(0, 60)), tuple(range(60, 120))]
    outs = {}
    for name, min_context in (("plain", None), ("split", 180)):
        runner = prefilled(model_dir, "triton", prompts, tables)
        assert runner.graphs is not None
        runner.graphs.split_min_context = min_context
        runs = [TokenRun([p[-1]], len(p), t) for p, t in zip(prompts, tables)]
        outs[name] = (runner.last_logits(runs)[: len(runs)].clone(), runner.graphs.captured)
    assert any(len(k) == 4 for k in outs["split"][1]) and not any(len(k) == 4 for k in outs["plain"][1])
    assert torch.equal(outs["split"][0], outs["plain"][0])
