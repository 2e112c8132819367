"""The EAGLE-3 head layout of bench/drafts/eagle3_bin_head.py (the official releases' pytorch_model.bin in
float16 with midlayer.*, fc, norm, lm_head, d2t, t2d, and their config.json keys only) at a tiny shape:
it loads through `--draft eagle:DIR` with a draft vocabulary that is a scattered subset of the target's,
and drafts losslessly (greedy output equal to no speculation)."""

from __future__ import annotations

import importlib.util
import pathlib

import torch
from engine_helpers import make_engine
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model.eagle_head import load_eagle_head
from verifypd.model.loader import load_model

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "drafts" / "eagle3_bin_head.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("eagle3_bin_head", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_published_layout_loads_and_drafts_losslessly(tiny_models, tmp_path):
    bench = bench_module()
    target = load_model(tiny_models[0], torch.device("cpu"), torch.float32)
    vocab = target.shape.vocab_size
    state = bench.write_published_head(tmp_path / "head", target.shape, draft_vocab=vocab // 2, seed=4)
    raw = (tmp_path / "head" / "config.json").read_text()
    assert "target_hidden_size" not in raw and "eagle_config" not in raw and '"draft_vocab_size"' in raw
    assert state["fc.weight"].dtype == torch.float16 and state["t2d"].dtype == torch.bool
    config, weights = load_eagle_head(
        str(tmp_path / "head"), target.shape, target.weights.lm_head, torch.device("cpu"), torch.float32
    )
    ids = state["d2t"] + torch.arange(vocab // 2)
    assert config.draft_vocab_size == vocab // 2 and torch.equal(weights.draft_to_target, ids)
    assert bool((ids != torch.arange(vocab // 2)).any()) and torch.equal(state["t2d"].nonzero().flatten(), ids)
    prompts = random_prompts(3, seed=11)
    outputs = {}
    for draft, k in (("none", 0), (f"eagle:{tmp_path / 'head'}", 3)):
        engine = make_engine(tiny_models[0], draft, k=k)
        done = engine.generate(
            [RequestSpec(tuple(p), max_tokens=12, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
        )
        outputs[k] = [done[str(i)].token_ids for i in range(len(prompts))]
    assert outputs[3] == outputs[0]


def test_specforge_style_safetensors_with_its_embeddings_loads_the_same_head(tiny_models, tmp_path):
    """SpecForge's save_pretrained: model.safetensors with the same names plus embed_tokens.weight (the
    target's embeddings, ignored: the head uses the target's own) and a "model." prefix on some names."""
    from safetensors.torch import save_file

    bench = bench_module()
    target = load_model(tiny_models[0], torch.device("cpu"), torch.float32)
    state = bench.write_published_head(tmp_path / "bin", target.shape, draft_vocab=40, seed=6)
    st = {("model." + k if k.startswith("midlayer.") else k): v for k, v in state.items()}
    st["embed_tokens.weight"] = torch.randn(target.shape.vocab_size, target.shape.hidden_size).half()
    (tmp_path / "st").mkdir()
    save_file(st, str(tmp_path / "st" / "model.safetensors"))
    (tmp_path / "st" / "config.json").write_text((tmp_path / "bin" / "config.json").read_text())
    cpu = torch.device("cpu")
    _, a = load_eagle_head(str(tmp_path / "bin"), target.shape, target.weights.lm_head, cpu, torch.float32)
    _, b = load_eagle_head(str(tmp_path / "st"), target.shape, target.weights.lm_head, cpu, torch.float32)
    assert torch.equal(a.layer.qkv, b.layer.qkv) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.draft_to_target, b.draft_to_target)
