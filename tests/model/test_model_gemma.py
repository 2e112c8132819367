"""Gemma (v1) on tiny random checkpoints written by transformers (head_dim 32 while hidden / heads is
16; tied embeddings; GeGLU; (1 + w) norms with random w; embeddings scaled by sqrt(hidden)): our
paged forward's logits match transformers', and greedy decoding through the engine (k = 0, a Gemma
draft, a self-draft, the Triton kernels under the interpreter) reproduces `transformers.generate`."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import DEVICE, hf_greedy, make_engine, write_tiny_llama
from paged_logits import forward_runs, relative_logit_errors
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import GEMMA, RANDOM_SHAPES, ModelLoadError, load_model, random_model, random_shape
from verifypd.model.runner import TokenRun

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
GEMMA_DIMS = dict(model_type="gemma", layers=3, hidden=64, heads=4, kv_heads=1, head_dim=32)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory) -> tuple[str, str]:
    """A tiny Gemma target and a noisy copy of it as draft (same vocabulary: accepts and rejects)."""
    root = tmp_path_factory.mktemp("gemma")
    target = write_tiny_llama(root / "target", seed=3, **GEMMA_DIMS)
    draft = write_tiny_llama(root / "draft", seed=3, noise=0.2, noise_seed=5, **GEMMA_DIMS)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def hf_gemma(gemma_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_models[0], dtype=torch.float32).eval()


def test_loader_reads_gemma_layout(gemma_models, hf_gemma):
    loaded = load_model(gemma_models[0], torch.device(DEVICE), torch.float32)
    s = loaded.shape
    assert (s.head_dim, s.num_heads * s.head_dim, s.hidden_size) == (32, 128, 64)
    assert (s.mlp_activation, s.embed_scale, s.norm_offset) == ("gelu_tanh", True, 1.0)
    assert loaded.weights.lm_head is loaded.weights.embed  # tied
    norm = hf_gemma.model.layers[0].input_layernorm.weight
    assert torch.equal(loaded.weights.layers[0].input_norm.cpu(), 1.0 + norm)  # folded (1 + w)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_logits_match_transformers_prefill_and_decode(gemma_models, hf_gemma, backend):
    """Two sequences prefilled together, then decoded together token by token through the paged KV
    (shuffled block ids, contexts crossing blocks): every logit row against transformers'."""
    loaded = load_model(gemma_models[0], torch.device(DEVICE), torch.float32)
    model = PagedLlama(loaded.shape, loaded.weights, attention=backend)
    for err in relative_logit_errors(model, hf_gemma, decode_steps=5):
        assert err < 1e-5, f"relative logits error {err:.2e}"


@pytest.fixture(scope="module")
def gemma_references(gemma_models, hf_gemma):
    """Greedy outputs of transformers for a few prompts."""
    prompts = random_prompts(4, seed=24)
    outputs = [hf_greedy(hf_gemma, list(p), NEW_TOKENS) for p in prompts]
    assert len({t for out in outputs for t in out}) > 10  # not a model that repeats one token
    # hf_greedy's min_new_tokens suppresses EOS, which the engine (stop_at_eos=False) does not: the
    # prompts are chosen so that greedy never lands on it.
    assert all(hf_gemma.config.eos_token_id not in out for out in outputs)
    return prompts, outputs


def _generate(engine, prompts) -> tuple[list[list[int]], list]:
    done = engine.generate(
        [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    return [done[str(i)].token_ids for i in range(len(prompts))], list(done.values())


@pytest.mark.parametrize("draft,k", [("model", 0), ("model", 3), ("self:1", 2)])
def test_greedy_matches_transformers(gemma_models, gemma_references, draft, k):
    prompts, expected = gemma_references
    engine = make_engine(gemma_models[0], gemma_models[1] if draft == "model" else draft, k=k)
    outputs, completions = _generate(engine, prompts)
    assert outputs == expected
    if draft == "model" and k:  # the noisy Gemma draft: both accepts and rejects were seen
        drafted = sum(c.usage["draft_tokens"] for c in completions)
        assert 0 < sum(c.usage["accepted_tokens"] for c in completions) < drafted


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("k", [0, 3])
def test_triton_backend_matches_transformers(gemma_models, gemma_references, monkeypatch, k):
    pytest.importorskip("triton")
    prompts, expected = gemma_references
    monkeypatch.setenv("VERIFYPD_ATTENTION", "triton")
    engine = make_engine(*gemma_models, k=k)
    assert engine.models.target_model.attention == "triton"
    assert _generate(engine, prompts[:2])[0] == expected[:2]


def test_draft_must_share_the_targets_vocabulary(tmp_path, gemma_models):
    other = write_tiny_llama(tmp_path / "llama", seed=1, layers=1, vocab=128)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        make_engine(gemma_models[0], str(other), k=2)


def test_random_shapes():
    gemma, tied = random_shape("gemma-7b", None)
    assert tied and gemma.head_dim == 256 and gemma.num_heads * gemma.head_dim == 4096 != gemma.hidden_size
    assert (gemma.vocab_size, gemma.mlp_activation, gemma.embed_scale) == (256000, "gelu_tanh", True)
    qwen, tied = random_shape("qwen2-7b", None)
    assert not tied and qwen.qkv_bias and (qwen.vocab_size, qwen.head_dim) == (152064, 128)
    assert random_shape("llama-2-7b", None)[0].vocab_size == 32000
    for name in ("qwen2-1.5b", "gemma-2b"):
        random_shape(name, 1024)


def test_random_gemma_model_runs(monkeypatch):
    monkeypatch.setitem(
        RANDOM_SHAPES,
        "tiny-gemma",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            vocab_size=50,
            **GEMMA,
        ),
    )
    loaded = random_model("tiny-gemma", torch.device(DEVICE), torch.float32, 64)
    assert loaded.weights.lm_head is loaded.weights.embed
    model = PagedLlama(loaded.shape, loaded.weights, attention="reference")
    pool = torch.zeros(2, 2, 4, 4, 1, 32, device=DEVICE)
    logits = forward_runs(model, pool, [TokenRun([1, 2, 3, 4, 5], 0, (1, 3))], 4)
    assert logits.shape == (5, 50) and torch.isfinite(logits).all()
