"""A feature draft call through its static buffers (the CUDA graphs' path: catch-up graph + chain
graph, padded to batch buckets) proposes exactly what the eager path proposes, call after call with
changing batch sizes, catch-up lengths, k and sampling; and the fused head-input kernel (Triton)
drafts what the torch reference drafts. On the CPU the graphs' functions run directly over the
static buffers (EagleRunner graphs="eager"); with VERIFYPD_TEST_DEVICE=cuda they are captured."""

from __future__ import annotations

import os
import random

import pytest
import torch
from engine_helpers import DEVICE

from verifypd.domain.requests import SamplingParams
from verifypd.model.eagle_draft import EagleModel, EagleRunner, FeatureRun
from verifypd.model.eagle_head import random_eagle_head
from verifypd.model.features import FeaturePool
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.llama import LlamaShape

pytestmark = pytest.mark.slow  # captured draft calls, partly on the Triton interpreter (tests/README.md)

BLOCK, BLOCKS_PER_RUN, NUM_BLOCKS = 4, 16, 256
SHAPE = LlamaShape(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_context=256,
)
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)


def make_head(attention: str, draft_vocab):
    device = torch.device(DEVICE)
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(SHAPE.vocab_size, SHAPE.hidden_size, generator=gen).to(device)
    config, weights = random_eagle_head(SHAPE, seed=2, draft_vocab=draft_vocab, std=0.3, device=device)
    features = FeaturePool(NUM_BLOCKS * BLOCK, config.aux_layer_ids, SHAPE.hidden_size, torch.float32, device)
    features.tensor.copy_(torch.randn(features.tensor.shape, generator=gen))
    return EagleModel(config, weights, embed, attention=attention), features


def make_runner(model, features, graphs, seed=9):
    pool = KvPool(
        "draft",
        PoolGeometry(1, NUM_BLOCKS, BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim),
        torch.float32,
        torch.device(DEVICE),
    )
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(seed)))  # same "old" KV
    return EagleRunner(model, pool, features, graphs=graphs, buckets=(1, 2, 4, 8))


def calls(seed=0):
    """(runs, ks, samplings) of successive draft calls: batch 3, 1, 5, 2, 8; catch-ups of 1..5
    tokens (some from position 0), k 1..6, greedy, sampled and truncated rows."""
    rng = random.Random(seed)
    out = []
    for batch, sampled in ((3, False), (1, False), (5, True), (2, False), (8, True), (3, False)):
        runs, ks, samplings = [], [], []
        for i in range(batch):
            length = rng.randint(1, 5)
            start = rng.choice([0, rng.randint(1, 30)]) if length > 1 else rng.randint(1, 30)
            blocks = tuple(range(i * BLOCKS_PER_RUN, (i + 1) * BLOCKS_PER_RUN))
            target_blocks = tuple(b + 8 * BLOCKS_PER_RUN for b in blocks)[::-1]  # another block order
            runs.append(
                FeatureRun(
                    [rng.randrange(3, SHAPE.vocab_size) for _ in range(length)],
                    start,
                    blocks,
                    target_block_ids=target_blocks,
                )
            )
            ks.append(rng.randint(1, 6))
            if sampled and i % 3 == 1:
                samplings.append(SamplingParams(temperature=0.9, seed=rng.randrange(1 << 64)))
            elif sampled and i % 3 == 2:
                samplings.append(SamplingParams(temperature=1.2, top_k=7, seed=rng.randrange(1 << 64)))
            else:
                samplings.append(SamplingParams())
        out.append((runs, ks, samplings))
    out.append(
        ([FeatureRun([11, 12], 20, tuple(range(16)), target_block_ids=tuple(range(16, 32)))], [1], [SamplingParams()])
    )
    return out


def proposals(runner, call_list):
    result = []
    for runs, ks, samplings in call_list:
        tokens = runner.draft(runs, ks, samplings).tolist()
        result.append([row[:k] for row, k in zip(tokens, ks)])
    return result


# CUDA captures only the Triton backend (the reference attention syncs the host); on the CPU both
# backends, Triton (the interpreter, slow) once.
CASES = (
    [("triton", None), ("triton", 40)]
    if DEVICE == "cuda"
    else [("reference", None), ("reference", 40), pytest.param("triton", 40, marks=needs_triton)]
)


@pytest.mark.parametrize("attention,draft_vocab", CASES)
def test_captured_draft_calls_propose_what_the_eager_path_proposes(attention, draft_vocab):
    model, features = make_head(attention, draft_vocab)
    eager = make_runner(model, features, graphs=False)
    graphed = make_runner(model, features, graphs="eager" if DEVICE == "cpu" else True)
    assert graphed.graphs is not None and eager.graphs is None
    call_list = calls()
    if DEVICE == "cpu" and attention == "triton":  # the interpreter is slow: the first four calls
        call_list = call_list[:4]
    expected = proposals(eager, call_list)
    got = proposals(graphed, call_list)
    assert got == expected
    torch.testing.assert_close(graphed.pool.tensor, eager.pool.tensor)  # and the same KV written


def test_catch_ups_longer_than_the_graphs_query_go_through_the_graphs():
    """A request that plain-decoded for a while catches up on more tokens than the graphs' query
    (9): its older rows are written by a ragged forward first and the rest is a graphed call, with
    the proposals and the KV of the eager path (which ran such calls before)."""
    model, features = make_head("triton" if DEVICE == "cuda" else "reference", 40)  # CUDA captures Triton only
    eager = make_runner(model, features, graphs=False)
    graphed = make_runner(model, features, graphs="eager" if DEVICE == "cpu" else True)
    rng = random.Random(4)
    call_list = []
    for lengths in ((12,), (30, 3, 9), (10, 41)):
        runs = [
            FeatureRun(
                [rng.randrange(3, SHAPE.vocab_size) for _ in range(n)],
                start,
                tuple(range(i * BLOCKS_PER_RUN, (i + 1) * BLOCKS_PER_RUN)),
                target_block_ids=tuple(range((i + 8) * BLOCKS_PER_RUN, (i + 9) * BLOCKS_PER_RUN)),
            )
            for i, (n, start) in enumerate(zip(lengths, (0, 5, 17)))
        ]
        call_list.append((runs, [4] * len(runs), [SamplingParams()] * len(runs)))
    calls_before = graphed.graphs.calls
    assert proposals(graphed, call_list) == proposals(eager, call_list)
    assert graphed.graphs.calls == calls_before + len(call_list)  # every call went through the graphs
    torch.testing.assert_close(graphed.pool.tensor, eager.pool.tensor)


@needs_triton
def test_fused_head_input_drafts_what_the_reference_drafts():
    if DEVICE == "cuda":
        pytest.skip("compared on the CPU (interpreter); on the GPU the graphs test above covers the kernel")
    call_list = [c for c in calls(seed=3) if all(s.greedy for s in c[2])]
    reference = proposals(make_runner(*make_head("reference", 40), graphs=False), call_list)
    fused = proposals(make_runner(*make_head("triton", 40), graphs=False), call_list)
    assert fused == reference


def test_engine_through_the_graphed_call_path_drafts_as_the_eager_path(tiny_models, tmp_path):
    """The router's real calls (catch-ups after partial acceptance, batches that shrink as requests
    finish) through the graphs' path: greedy output == plain decoding, and every request's accepted
    draft count == the eager path's (same proposals; k fixed, so nothing depends on timing). On the
    CPU the graphs' functions run over the static buffers; on CUDA the engine captured them."""
    from engine_cases import write_head
    from engine_helpers import eager_and_graphed, make_engine
    from test_model_greedy_lossless import random_prompts

    from verifypd.domain.requests import RequestSpec

    prompts = random_prompts(6, seed=8)
    head = write_head(tiny_models, tmp_path / "head", draft_vocab=64)
    specs = lambda: [RequestSpec(p, max_tokens=16, stop_at_eos=False) for p in prompts]  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0)
    expected = [c.token_ids for c in plain.generate(specs()).values()]
    eager, graphed, runner = eager_and_graphed(tiny_models[0], head)
    usage = []
    for engine in (eager, graphed):
        done = engine.generate(specs())
        assert [c.token_ids for c in done.values()] == expected
        usage.append([(c.usage["draft_tokens"], c.usage["accepted_tokens"]) for c in done.values()])
    assert usage[1] == usage[0] and sum(a for _, a in usage[0]) > 0
    assert runner.graphs.calls > 0  # the path was taken
