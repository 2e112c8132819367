"""The benchmark's peer (bench/engine/static_decoder.py, a static-batch decoder for --rows compiled) must
compute what the engine computes: its greedy tokens equal the engine's plain decoding."""

from __future__ import annotations

import pathlib
import sys

import torch
from engine_helpers import VOCAB, make_engine

from verifypd.domain.requests import RequestSpec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "engine"))


def test_static_decoder_tokens_equal_the_engine(tiny_models):
    from static_decoder import StaticDecoder

    engine = make_engine(*tiny_models, k=0)
    B, P, G = 4, 11, 16
    prompts = torch.randint(3, VOCAB, (B, P), generator=torch.Generator().manual_seed(5))
    done = engine.generate(
        [
            RequestSpec(tuple(p.tolist()), max_tokens=G, stop_at_eos=False, request_id=str(i))
            for i, p in enumerate(prompts)
        ]
    )
    model = engine.verify_lane.target.model
    peer = StaticDecoder(model, B, P + G, compile=False)  # the compiled layer is the same function
    out = peer.generate(prompts.to(model.weights.embed.device), G).cpu()
    assert out.tolist() == [done[str(i)].token_ids for i in range(B)]
