"""Every family beyond Llama 2 / Gemma 1, exact against transformers on tiny random checkpoints written
with its own config class (support/family_checkpoints.py): Llama 3.2 (llama3 RoPE, tied head), Mistral
(sliding window), Qwen3 (q/k norms), Gemma 2 (soft caps, query_pre_attn_scalar, alternating windows,
four norms), Gemma 3 text (q/k norms, local RoPE base, linear-scaled global RoPE) and Phi-3 (fused
projections, longrope, window). Our paged forward's logits against transformers' (reference path and
the Triton kernels under the interpreter), and greedy decoding through the engine (no speculation, a
self-draft, the default prompt-lookup draft) against `transformers.generate`."""

from __future__ import annotations

import os
import random

import pytest
import torch
from engine_helpers import DEVICE, VOCAB, make_engine
from family_checkpoints import FAMILIES, LONGROPE_CONTEXT, WINDOW, hf_greedy_through_eos, write_family
from paged_logits import forward_runs, relative_logit_errors

from verifypd.domain.requests import RequestSpec
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import RANDOM_SHAPES, ModelLoadError, load_model, random_model, random_shape
from verifypd.model.runner import TokenRun

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
NEW_TOKENS = 16

# What each tiny checkpoint must have switched on in our shape (a family that loses a feature fails here
# before the numbers are compared).
EXPECTED_FEATURES = {
    "llama3.2": dict(rope_type="llama3", tied=True),
    "mistral": dict(sliding_window=WINDOW, sliding_layers=(0, 1, 2)),
    "qwen3": dict(qk_norm=True, head_dim=32),
    "gemma2": dict(
        sliding_window=WINDOW, sliding_layers=(0, 2), attn_softcap=1.5, final_softcap=4.0, sandwich_norms=True
    ),
    "gemma3_text": dict(
        qk_norm=True,
        sandwich_norms=True,
        sliding_layers=(0, 2),
        local_rope_theta=10000.0,
        rope_type="linear",
        attn_softcap=None,  # set in the config, unused by transformers' Gemma 3: unused here too
        final_softcap=6.0,
    ),
    "phi3": dict(rope_type="longrope", max_context=LONGROPE_CONTEXT, sliding_layers=(0, 1, 2)),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, checkpoint dir, transformers' model with eager attention: the soft caps are honoured)."""
    from transformers import AutoModelForCausalLM

    path = write_family(tmp_path_factory.mktemp(request.param.replace(".", "_")), request.param, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, str(path), hf


def test_family_features_are_read(family):
    name, path, _ = family
    loaded = load_model(path, torch.device(DEVICE), torch.float32)
    s = loaded.shape
    for key, want in EXPECTED_FEATURES[name].items():
        if key == "rope_type":
            assert (s.rope_scaling or {}).get("rope_type") == want
        elif key == "tied":
            assert (loaded.weights.lm_head is loaded.weights.embed) == want
        else:
            assert getattr(s, key) == want, key


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_logits_match_transformers(family, backend):
    """Two sequences (longer than the window) prefilled together, then decoded together through the
    paged KV (shuffled blocks): every logit row against transformers' forward of the whole sequence."""
    name, path, hf = family
    loaded = load_model(path, torch.device(DEVICE), torch.float32)
    model = PagedLlama(loaded.shape, loaded.weights, attention=backend)
    for err in relative_logit_errors(model, hf, decode_steps=5):
        assert err < 1e-5, f"{name}: relative logits error {err:.2e}"


@pytest.fixture(scope="module")
def references(family):
    """transformers' greedy outputs for prompts longer than the window."""
    _, _, hf = family
    rng = random.Random(31)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(n)) for n in (9, 14, 19)]
    outputs = [hf_greedy_through_eos(hf, list(p), NEW_TOKENS) for p in prompts]
    assert len({t for out in outputs for t in out}) > 8  # not a model that repeats one token
    return prompts, outputs


@pytest.mark.parametrize("draft,k", [("none", 0), ("self:1", 3), ("ngram", 3)])
def test_greedy_matches_transformers(family, references, draft, k):
    _, path, _ = family
    prompts, expected = references
    engine = make_engine(path, draft, k=k, max_context=LONGROPE_CONTEXT)  # Phi-3's longrope: its original context
    done = engine.generate(
        [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    assert [done[str(i)].token_ids for i in range(len(prompts))] == expected


def test_longrope_past_the_original_context_is_refused(family):
    """transformers re-encodes a longrope sequence with the long factors once it passes the original
    context (Phi-3's generate drops its cache there): paged KV cannot, so a longer context is refused."""
    name, path, _ = family
    if name != "phi3":
        pytest.skip("longrope is Phi-3's")
    with pytest.raises(ModelLoadError, match=f"original_max_position_embeddings.*--max-context {LONGROPE_CONTEXT}"):
        load_model(path, torch.device(DEVICE), torch.float32, max_context=2 * LONGROPE_CONTEXT)
    assert load_model(path, torch.device(DEVICE), torch.float32, LONGROPE_CONTEXT).shape.max_context == 64


def test_random_shapes_of_the_families(monkeypatch):
    """The benchmark shapes: features as their configs, and a random model with every feature runs."""
    gemma2, tied = random_shape("gemma-2-9b", 8192)
    assert tied and (gemma2.window(0), gemma2.window(1), gemma2.final_softcap) == (4096, 0, 30.0)
    assert random_shape("qwen3-8b", None)[0].qk_norm
    assert random_shape("phi-3-mini", None)[0].window(31) == 2047
    assert random_shape("llama-3.1-8b", None)[0].rope_scaling["rope_type"] == "llama3"
    tiny = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    features = dict(qk_norm=True, sandwich_norms=True, attn_softcap=5.0, sliding_window=3, sliding_layers=(0,))
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-all", dict(vocab_size=50, **tiny, **features))
    loaded = random_model("tiny-all", torch.device(DEVICE), torch.float32, 64)
    model = PagedLlama(loaded.shape, loaded.weights, attention="reference")
    pool = torch.zeros(2, 2, 4, 4, 1, 16, device=DEVICE)
    logits = forward_runs(model, pool, [TokenRun([1, 2, 3, 4, 5], 0, (1, 3))], 4)
    assert logits.shape == (5, 50) and torch.isfinite(logits).all()
