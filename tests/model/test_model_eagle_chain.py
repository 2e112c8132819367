"""The paged draft chain (serving) and the dense unrolled forward (`verifypd distill` trains it) are
the same function: feature alignment, chain hidden states, the training-time-test attention."""

from __future__ import annotations

import torch
from engine_helpers import write_tiny_llama

from verifypd.distill.capture import TargetCapture
from verifypd.distill.head_train import TrainableHead
from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.model.eagle_draft import EagleModel, EagleRunner, FeatureRun
from verifypd.model.eagle_head import random_eagle_head
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.loader import load_model
from verifypd.model.runner import TokenRun

CPU = torch.device("cpu")


def test_paged_chain_equals_dense_unrolled_forward(tmp_path):
    target = load_model(str(write_tiny_llama(tmp_path / "t", seed=4, layers=6)), CPU, torch.float32)
    config, weights = random_eagle_head(target.shape, seed=2, draft_vocab=70, std=0.3)
    capture = TargetCapture(target, config.aux_layer_ids, CPU, max_tokens=256)
    prompt = [1, 9, 23, 40, 7, 61, 12, 5, 33]  # x_0 .. x_n, x_n pending
    n, K = len(prompt) - 1, 5
    # Serving: the target's forward writes features of positions 0 .. n - 1, then the head drafts.
    capture.runner.forward([TokenRun(prompt[:-1], 0, (0, 1))], None)
    model = EagleModel(config, weights, target.weights.embed)  # VERIFYPD_ATTENTION picks the kernels
    pool = KvPool("draft", PoolGeometry(1, 8, 4, config.num_kv_heads, config.head_dim), torch.float32, CPU)
    runner = EagleRunner(model, pool, capture.features)
    head = TrainableHead(config, weights, target.weights.embed)
    for sampling in [SamplingParams()] + [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 2**64 - 1, 0)]:
        drafts = runner.draft([FeatureRun(prompt, 0, (0, 1, 2, 3), target_block_ids=(0, 1))], [K], [sampling])[
            0
        ].tolist()
        # Dense: the sequence continued by the drafts; row t = features of position t + token t + 1.
        seq = prompt + drafts
        features = torch.zeros(1, len(seq) - 1, 3 * config.hidden_size)
        features[0, :n] = capture.features.read(torch.arange(n))
        with torch.no_grad():
            logits = head(torch.tensor([seq[1:]]), features, steps=K)
        for j in range(K):  # step j at row n - 1 + j drafted token n + 1 + j
            dense = torch.full((target.shape.vocab_size,), float("-inf"))
            dense[weights.draft_to_target] = logits[j][0, n - 1 + j]
            # The paged chain chose the race winner of the dense distribution (seed, position n + 1 + j).
            expected = (
                dense.argmax()
                if sampling.greedy
                else sampler.race(
                    dense.softmax(-1)[None], sampler.seed_tensor([sampling.seed], "cpu"), torch.tensor([n + 1 + j])
                )[0]
            )
            assert drafts[j] == int(expected), (sampling, j)
