"""One-sequence prefill chunks through the prefill graphs (ModelRunner.capture_prefill_graphs): padded
to the next query bucket, right-aligned, they give the eager ragged forward's last-token logits and
write the same KV, from position 0 and from the middle of a prompt (chunked prefill); what the
graphs do not take (longer chunks, several sequences, every token's logits) runs eagerly. On the
CPU the graphs' functions run over their static buffers (graphs="eager"); with
VERIFYPD_TEST_DEVICE=cuda they are captured."""

from __future__ import annotations

import random

import torch
from engine_helpers import DEVICE, VOCAB

from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model
from verifypd.model.runner import ModelRunner

BLOCK, NUM_BLOCKS = 4, 96
QUERIES = (16, 64)


def make_runner(model_dir: str, graphs):
    loaded = load_model(model_dir, torch.device(DEVICE), torch.float32)
    s = loaded.shape
    pool = KvPool(
        "target",
        PoolGeometry(s.num_layers, NUM_BLOCKS, BLOCK, s.num_kv_heads, s.head_dim),
        torch.float32,
        torch.device(DEVICE),
    )
    runner = ModelRunner(PagedLlama(s, loaded.weights), pool, graphs=graphs)
    if graphs:
        runner.capture_prefill_graphs(QUERIES)
    return runner


def test_prefill_chunks_through_the_graphs_equal_the_eager_forward(tiny_models):
    graphed = make_runner(tiny_models[0], "eager" if DEVICE == "cpu" else True)
    eager = make_runner(tiny_models[0], False)
    assert graphed.prefill_graphs is not None and eager.prefill_graphs is None
    replays = []
    last_logits = graphed.prefill_graphs.last_logits
    graphed.prefill_graphs.last_logits = lambda runs, query, *rest: (
        replays.append(query) or last_logits(runs, query, *rest)
    )
    rng = random.Random(3)
    tokens = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    blocks = lambda i: tuple(range(i * 24, (i + 1) * 24))  # noqa: E731  24 blocks: 96 positions
    prompt = tokens(57)
    calls = [
        ([TokenRun(tokens(5), 0, blocks(0))], "last"),  # 5 tokens padded to 16
        ([TokenRun(prompt[:37], 0, blocks(1))], "last"),  # 37 -> 64
        ([TokenRun(prompt[37:], 37, blocks(1))], "last"),  # the prompt's second chunk: 20 -> 64
        ([TokenRun(tokens(16), 0, blocks(2))], None),  # KV only, exactly a bucket
        ([TokenRun(tokens(70), 0, blocks(3))], "last"),  # past the largest bucket: eager
        ([TokenRun(tokens(9), 0, blocks(0)[:6]), TokenRun(tokens(12), 9, blocks(2))], "last"),  # two: eager
        ([TokenRun(tokens(11), 16, blocks(2))], "all"),  # every token's logits: eager
    ]
    for runs, logits_for in calls:
        got, expected = graphed.forward(runs, logits_for), eager.forward(runs, logits_for)
        if logits_for is not None:
            torch.testing.assert_close(got[: expected.shape[0]], expected, rtol=1e-4, atol=1e-4)
            assert got.shape == expected.shape
    assert replays == [16, 64, 64, 16]
    torch.testing.assert_close(graphed.pool.tensor, eager.pool.tensor, rtol=1e-4, atol=1e-4)  # the same KV


def test_a_feature_drafts_prefill_rows_through_its_graphs_equal_the_ragged_forward():
    """The head's rows of a prefill chunk (EagleRunner.prefill): one sequence through its prefill
    graphs writes the KV the ragged forward writes; several sequences go the ragged way."""
    from test_model_eagle_capture import BLOCKS_PER_RUN, SHAPE, make_head
    from test_model_eagle_capture import make_runner as make_eagle_runner

    from verifypd.model.eagle_draft import FeatureRun

    model, features = make_head("triton" if DEVICE == "cuda" else "reference", 40)
    graphed = make_eagle_runner(model, features, graphs="eager" if DEVICE == "cpu" else True)
    graphed.capture_prefill_graphs(QUERIES)
    ragged = make_eagle_runner(model, features, graphs=False)
    replays = []
    draft = graphed.prefill_graphs.draft
    graphed.prefill_graphs.draft = lambda *args: replays.append(args[-1]) or draft(*args)
    rng = random.Random(8)

    def tokens(n):
        return [rng.randrange(3, SHAPE.vocab_size) for _ in range(n)]

    def run(ids, start, i):
        return FeatureRun(
            ids,
            start,
            tuple(range(i * BLOCKS_PER_RUN, (i + 1) * BLOCKS_PER_RUN)),
            target_block_ids=tuple(range((i + 8) * BLOCKS_PER_RUN, (i + 9) * BLOCKS_PER_RUN)),
        )

    prompt = tokens(50)
    for runs in (
        [run(tokens(6), 0, 0)],
        [run(prompt[:30], 0, 1)],
        [run(prompt[30:], 30, 1)],
        [run(tokens(9), 0, 2), run(tokens(4), 7, 3)],
    ):
        graphed.prefill(runs)
        ragged.prefill(runs)
    assert replays == [16, 64, 64]  # rows: 5, 29 (x_0 has none), 20; the pair went ragged
    torch.testing.assert_close(graphed.pool.tensor, ragged.pool.tensor)
