"""The random-weight bench shapes of the large targets are the published models' shapes:
each published config.json (its fields as on the Hugging Face hub, typed in here: no download) read
by the real loader (`shape_from_config`) gives the same LlamaShape as `random:NAME`."""

from __future__ import annotations

import dataclasses

import pytest

from verifypd.model.families import shape_from_config
from verifypd.model.loader import random_shape

LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False)
PUBLISHED = {  # meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B
    "llama-2-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "llama-3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_random_shape_is_the_published_config(name):
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA, **PUBLISHED[name])
    published = shape_from_config(config, max_context=4096)
    shape, tied = random_shape(name, 4096)
    assert not tied
    assert dataclasses.asdict(shape) == dataclasses.asdict(published)
    assert shape.head_dim == 128


def test_llama3_pair_shares_the_vocabulary():
    """A Llama-3-8B draft can serve a Llama-3-70B target only with the same vocabulary."""
    small, big = random_shape("llama-3-8b", None)[0], random_shape("llama-3-70b", None)[0]
    assert small.vocab_size == big.vocab_size == 128256
    assert small.rope_theta == big.rope_theta == 500000.0
