"""Bad inputs fail with a clear message naming what to fix, at the engine and at the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from engine_helpers import DEVICE, make_engine

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import InvalidRequest, RequestSpec, SamplingParams


@pytest.fixture(scope="module")
def router(tiny_models):
    return make_engine(*tiny_models, k=2).router


@pytest.mark.parametrize(
    "spec, message",
    [
        (RequestSpec(()), "prompt is empty"),
        (RequestSpec(tuple([5] * 256)), "context is 256"),
        (RequestSpec((5,), max_tokens=0), "max_tokens must be >= 1"),
        (RequestSpec((5,), max_tokens=-3), "max_tokens must be >= 1"),
        (RequestSpec((5,), sampling=SamplingParams(temperature=-0.5)), "temperature must be"),
        (RequestSpec((5,), sampling=SamplingParams(temperature=float("nan"))), "temperature must be"),
        (RequestSpec((5,), sampling=SamplingParams(temperature=1, top_p=0.0)), r"top_p must be in \(0, 1\]"),
        (RequestSpec((5,), sampling=SamplingParams(temperature=1, top_p=1.5)), r"top_p must be in \(0, 1\]"),
        (RequestSpec((5,), sampling=SamplingParams(top_k=-1)), "top_k must be >= 0"),
        (RequestSpec((5,), max_k=-1), "k .* must be >= 0"),
        (RequestSpec((5,), max_k=99), "k must be <= 16"),
        (RequestSpec((5, 999)), r"token ids must be in \[0, 96\)"),
        (RequestSpec((5,), priority=1000), "priority must be in"),
        (RequestSpec((5,), stop=("",)), "stop strings must be non-empty"),
    ],
)
def test_bad_requests_are_rejected_with_a_message(router, spec, message):
    with pytest.raises(InvalidRequest, match=message):
        router.add_request(spec)
    assert not router.has_work()  # nothing half-admitted


def test_duplicate_request_id_is_rejected(router):
    router.add_request(RequestSpec((5, 6), request_id="same"))
    with pytest.raises(InvalidRequest, match="already in flight"):
        router.add_request(RequestSpec((5, 6), request_id="same"))
    router.abort("same")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(k_min=5, k_max=2), "k_min <= k_max"),
        (dict(k_initial=9, k_max=8), "k_initial <= k_max"),
        (dict(prefill_token_budget=0), "prefill_token_budget"),
    ],
)
def test_bad_runtime_config_is_rejected(changes, message):
    with pytest.raises(InvalidRequest, match=message):
        RuntimeConfig().updated(**changes)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verifypd.cli", *args], capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_cli_offline_json_and_errors(tiny_models):
    target, draft = tiny_models
    ok = _cli(
        "generate",
        "--offline",
        "w5 w6 w7",
        "--target",
        target,
        "--draft",
        draft,
        "--k",
        "3",
        "--max-tokens",
        "12",
        "--json",
        "--device",
        DEVICE,
        "--dtype",
        "float32",
        "--num-blocks",
        "64",
    )
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert len(result["token_ids"]) == 12 and isinstance(result["text"], str)
    assert set(result["usage"]) >= {"prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens"}
    assert result["usage"]["completion_tokens"] == 12 and result["usage"]["draft_tokens"] > 0
    for bad, message in (
        (["--k", "-1"], "--k must be >= 0"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max-tokens"),
    ):
        res = _cli("generate", "--offline", "w5", "--target", target, "--draft", draft, "--device", "cpu", *bad)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = _cli("generate", "--offline", "", "--target", target, "--draft", draft, "--device", "cpu")
    assert res.returncode == 2 and "prompt is empty" in res.stderr
    res = _cli("generate", "--offline", "hi", "--target", "/nonexistent/model")
    assert res.returncode == 2 and "cannot load model" in res.stderr and "Traceback" not in res.stderr


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    from verifypd.model.loader import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="'gpt2' is not supported; verifypd supports llama, mistral, qwen2"):
        load_model(str(tmp_path), "cpu", None)


def test_multimodal_gemma3_is_refused_naming_the_text_layout(tmp_path):
    from transformers import Gemma3Config

    Gemma3Config().save_pretrained(tmp_path)
    from verifypd.model.loader import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="multimodal.*'gemma3_text'"):
        load_model(str(tmp_path), "cpu", None)
