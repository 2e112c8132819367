"""A prefix-cache hit's short suffix through the split-KV prefill graphs (ModelRunner.prefill_splits,
model.split_kv): after a long cached prefix, the suffix (and each greedy token after it) replays the
("last", 1, Q, splits) graph, and gives the logits and greedy tokens of the uncached prompt computed in
one eager forward, fp32, Llama and Qwen2 (q/k/v biases). On the CPU the graphs' functions run over their
static buffers (graphs="eager") and the Triton kernels under TRITON_INTERPRET=1 (conftest.py); with
VERIFYPD_TEST_DEVICE=cuda they are captured."""

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

BLOCK, NUM_BLOCKS = 4, 40
QUERIES = (16, 32)
PREFIX, SUFFIX, GREEDY = 70, 6, 3


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return str(write_tiny_llama(root / "m", seed=4, layers=2, model_type=request.param))


def make_runner(model_dir: str, attention: str, graphs) -> ModelRunner:
    loaded = load_model(model_dir, torch.device(DEVICE), torch.float32)
    s = loaded.shape
    geometry = PoolGeometry(s.num_layers, NUM_BLOCKS, BLOCK, s.num_kv_heads, s.head_dim)
    pool = KvPool("target", geometry, torch.float32, torch.device(DEVICE))
    runner = ModelRunner(PagedLlama(s, loaded.weights, attention=attention), pool, graphs=graphs)
    runner.split_min_context = 32  # the tiny context's "long" prefix
    if graphs:
        runner.capture_prefill_graphs(QUERIES)
    return runner


def greedy(runner: ModelRunner, runs: list[TokenRun]) -> tuple[list[torch.Tensor], list[int]]:
    """Last logits of each call in turn; each greedy token is fed as the next call's run."""
    logits, tokens = [], []
    for n in range(GREEDY + 1):
        if n:
            runs = [TokenRun([tokens[-1]], runs[0].start_pos + len(runs[0].token_ids), runs[0].block_ids)]
        out = runner.forward(runs, "last")[:1].clone()
        logits.append(out)
        tokens.append(int(out.argmax(-1)))
    return logits, tokens


def test_cached_suffix_through_the_split_graph_equals_the_uncached_prompt(model_dir):
    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PREFIX + SUFFIX)]
    blocks = tuple(range(3, 3 + -(-(PREFIX + SUFFIX + GREEDY) // BLOCK)))

    uncached = make_runner(model_dir, "reference", False)  # the whole prompt, one eager forward
    want_logits, want_tokens = greedy(uncached, [TokenRun(prompt, 0, blocks)])

    cached = make_runner(model_dir, "triton", "eager" if DEVICE == "cpu" else True)
    assert cached.prefill_splits, "no split-KV prefill graph was captured"
    keys = []
    graph_for = cached.prefill_graphs.graph_for
    cached.prefill_graphs.graph_for = lambda key: keys.append(key) or graph_for(key)
    cached.forward([TokenRun(prompt[:PREFIX], 0, blocks)], None)  # the prefix: what the cache holds
    got_logits, got_tokens = greedy(cached, [TokenRun(prompt[PREFIX:], PREFIX, blocks)])

    splits = cached.prefill_splits[16]
    assert splits > 1 and keys == [("last", 1, 16, splits)] * (GREEDY + 1)  # every call went split
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_short_context_takes_the_plain_graph(model_dir):
    """Below split_min_context the plain ("last", 1, Q) graph runs (no combine launch for short prompts)."""
    runner = make_runner(model_dir, "triton", "eager" if DEVICE == "cpu" else True)
    keys = []
    graph_for = runner.prefill_graphs.graph_for
    runner.prefill_graphs.graph_for = lambda key: keys.append(key) or graph_for(key)
    runner.forward([TokenRun([5, 6, 7], 0, (1, 2))], "last")
    assert keys == [("last", 1, 16)]


@pytest.mark.slow  # the Triton interpreter over whole requests
def test_engine_prefix_hits_through_split_attention_equal_the_uncached_engine(model_dir, monkeypatch):
    """The whole engine (prompt lookup drafts k = 3, greedy): requests sharing a 40-token prefix, the
    cached engine's suffix prefills run split-KV attention (its eager path on the CPU), the uncached
    engine's the torch reference; same tokens, and the hits were hits."""
    from engine_helpers import make_engine

    from verifypd.domain.requests import RequestSpec

    rng = random.Random(6)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 7, 5)]

    def run(engine):
        out = []
        for n, p in enumerate(prompts):  # one at a time: each finds the ones before it cached
            done = engine.generate([RequestSpec(tuple(p), max_tokens=8, stop_at_eos=False, request_id=str(n))])
            out.append((done[str(n)].token_ids, done[str(n)].usage["cached_tokens"]))
        return out

    monkeypatch.setenv("VERIFYPD_ATTENTION", "reference")
    expected = run(make_engine(model_dir, "ngram", k=3, prefix_cache=False))
    monkeypatch.setenv("VERIFYPD_ATTENTION", "triton")
    engine = make_engine(model_dir, "ngram", k=3)
    runner = engine.verify_lane.target
    runner.split_min_context = 32
    splits: list[int] = []
    if runner.prefill_graphs is not None:  # CUDA: the hits replay the split graphs captured at start-up
        graphs, last_logits = runner.prefill_graphs, runner.prefill_graphs.last_logits
        graphs.last_logits = lambda runs, query, n=None: last_logits(runs, query, splits.append(n) or n)
    else:  # eager: the split count is picked per call
        splits_for = runner.splits_for
        runner.splits_for = lambda query: splits.append(splits_for(query)) or splits[-1]
    got = run(engine)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [c for _, c in got] == [0, 40, 40] and [c for _, c in expected] == [0, 0, 0]
    assert len([n for n in splits if n > 1]) == 2, splits  # the two hits' suffixes went split
