"""Feature drafts (`--draft eagle:PATH`, EAGLE-3-style heads): lossless with tiny random heads, and the
head's on-disk layout round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_cases import _second_token_marginal, chi_square_pvalue, sample_second_tokens, write_head
from engine_helpers import make_engine
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model.eagle_head import load_eagle_head, random_eagle_head, save_eagle_head
from verifypd.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        "full": write_head(tiny_models, root / "full"),
        "small_vocab": write_head(tiny_models, root / "small", draft_vocab=64),
        "target_lm_head": write_head(tiny_models, root / "shared", with_lm_head=False),
        "target_rows": write_head(tiny_models, root / "rows", draft_vocab=64, with_lm_head=False),
    }


@pytest.fixture(scope="module")
def plain(tiny_models):
    prompts = random_prompts(8, seed=5)
    engine = make_engine(tiny_models[0], "none", k=0)
    done = engine.generate([RequestSpec(p, max_tokens=20, stop_at_eos=False) for p in prompts])
    return prompts, [c.token_ids for c in done.values()]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["full", "small_vocab", "target_lm_head", "target_rows"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_head_equals_plain(tiny_models, heads, plain, head, k):
    prompts, expected = plain
    engine = make_engine(tiny_models[0], heads[head], k=k, block_size=4)
    done = engine.generate([RequestSpec(p, max_tokens=20, stop_at_eos=False) for p in prompts])
    assert [c.token_ids for c in done.values()] == expected
    assert sum(c.usage["draft_tokens"] for c in done.values()) > 0


@pytest.mark.slow
def test_greedy_with_head_and_adaptive_k_equals_plain(tiny_models, heads, plain):
    """k varies per step (and 0-steps make the head catch up over several verified positions)."""
    prompts, expected = plain
    engine = make_engine(tiny_models[0], heads["small_vocab"], k=2, adaptive=True)
    done = engine.generate([RequestSpec(p, max_tokens=20, stop_at_eos=False) for p in prompts])
    assert [c.token_ids for c in done.values()] == expected


@pytest.mark.slow
def test_sampling_with_head_follows_target(tiny_models, hf_target, heads):
    """The 2nd output token (the first a verify step makes) ~ the target's marginal, with the head's q
    over its 64-token draft vocabulary (zero elsewhere), and clearly not ~ uniform over it. (The race
    makes every seeded output equal --draft none's, below; this checks that output is the target's.)"""
    engine = make_engine(tiny_models[0], heads["small_vocab"], k=3, num_blocks=4096)
    prompt, temperature = (5, 17, 33), 1.5
    seconds = sample_second_tokens(engine, prompt, temperature, 2000, 5, 1000, hf_target.config.vocab_size)
    assert chi_square_pvalue(seconds, _second_token_marginal(hf_target, prompt, temperature)) > 1e-3
    uniform = np.zeros(hf_target.config.vocab_size)
    uniform[:64] = 1 / 64
    assert chi_square_pvalue(seconds, uniform) < 1e-6


@pytest.fixture(scope="module")
def seeded_plain(tiny_models):
    """test_model_seeded_output's subjects, each alone with no draft."""
    from engine_cases import run
    from test_model_seeded_output import subjects

    return {
        spec.request_id: run(make_engine(tiny_models[0], "none", k=0), [spec])[0][spec.request_id]
        for spec in subjects()
    }


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["k-fixed", "k-adaptive"])
def test_seeded_output_with_head_equals_plain(tiny_models, heads, seeded_plain, adaptive):
    """A seed names one output (docs/engine.md "Seeds"): with the head drafting (its race winners for
    the same seed and positions), alone and in a crowd, the tokens are --draft none's token for token;
    and some of the head's sampled drafts are kept, some refused."""
    from engine_cases import crowd, run
    from test_model_seeded_output import subject_tokens, subjects

    alone, stats = run(make_engine(tiny_models[0], heads["full"], k=4, adaptive=adaptive), subjects())
    assert subject_tokens(alone) == seeded_plain
    busy, _ = run(
        make_engine(tiny_models[0], heads["full"], k=4, adaptive=adaptive), crowd()[:4] + subjects() + crowd()[4:]
    )
    assert subject_tokens(busy) == seeded_plain
    drafted = sum(s.draft_tokens for s in stats.values())
    accepted = sum(s.accepted_tokens for s in stats.values())
    assert 0 < drafted and (adaptive or 0 < accepted < drafted), (accepted, drafted)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, pipeline, blocks", [("pdv", True, 128), ("pdv", False, 128), ("baseline", True, 24)]
)
def test_seeded_output_with_head_in_every_schedule_and_after_preemption(
    tiny_models, heads, seeded_plain, schedule, pipeline, blocks
):
    """Pipelined steps (drafts beside the other group's verify) and preemption by recompute (a
    re-prefill rewrites features and head rows) leave the seeded output alone."""
    from engine_cases import crowd, run
    from test_model_seeded_output import subject_tokens, subjects

    engine = make_engine(tiny_models[0], heads["full"], k=3, adaptive=True, num_blocks=blocks)
    engine.router.config = engine.router.config.updated(schedule=schedule, pipeline=pipeline)
    tokens, stats = run(engine, crowd(6, seed=5) + subjects())
    assert subject_tokens(tokens) == seeded_plain
    if blocks == 24:
        assert sum(stats[rid].preemptions for rid in seeded_plain) > 0, "the pool was not small enough to preempt"


def test_head_round_trips_through_the_published_layout(tiny_models, tmp_path):
    target = load_model(tiny_models[0], CPU, torch.float32)
    config, weights = random_eagle_head(target.shape, seed=1, draft_vocab=50)
    save_eagle_head(tmp_path, config, weights)
    loaded_config, loaded = load_eagle_head(str(tmp_path), target.shape, target.weights.lm_head, CPU, torch.float32)
    assert loaded_config == config
    for name in ("fc", "hidden_norm", "final_norm", "lm_head", "draft_to_target"):
        assert torch.equal(getattr(loaded, name), getattr(weights, name)), name
    assert torch.equal(loaded.layer.qkv, weights.layer.qkv) and torch.equal(loaded.layer.gate_up, weights.layer.gate_up)
    raw = (tmp_path / "config.json").read_text()
    assert "LlamaForCausalLMEagle3" in raw and "eagle_aux_hidden_state_layer_ids" in raw


def test_draft_vocabulary_over_the_targets_rows_loads_those_rows(tiny_models, tmp_path):
    """A head written without lm_head.weight but with a d2t map (distill --frozen-lm-head) drafts over
    the target's own lm_head rows of its draft vocabulary; a d2t of the wrong length is refused."""
    from safetensors.torch import load_file, save_file

    target = load_model(tiny_models[0], CPU, torch.float32)
    config, weights = random_eagle_head(target.shape, seed=2, draft_vocab=40)
    weights.draft_to_target = torch.randperm(target.shape.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    save_eagle_head(tmp_path, config, weights, with_lm_head=False)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded_config, loaded = load_eagle_head(str(tmp_path), target.shape, target.weights.lm_head, CPU, torch.float32)
    assert loaded_config.draft_vocab_size == 40
    assert torch.equal(loaded.draft_to_target, weights.draft_to_target)
    assert torch.equal(loaded.lm_head, target.weights.lm_head[weights.draft_to_target])
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["lm_head.weight"] = torch.zeros(39, target.shape.hidden_size)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t map"):
        load_eagle_head(str(tmp_path), target.shape, target.weights.lm_head, CPU, torch.float32)


def test_head_trained_on_short_sequences_drafts_past_its_training_length(tiny_models, tmp_path):
    """distill writes max_position_embeddings = its training length; served requests run longer (the
    head follows the target's context: its rope tables must cover every target position)."""
    target = load_model(tiny_models[0], CPU, torch.float32)
    config, weights = random_eagle_head(target.shape, seed=4, std=0.3)
    config.max_context = 8
    save_eagle_head(tmp_path, config, weights)
    prompt = tuple(int(t) for t in torch.randint(3, 90, (100,), generator=torch.Generator().manual_seed(1)))
    spec = lambda: [RequestSpec(prompt, max_tokens=12, stop_at_eos=False)]  # noqa: E731
    expected = [c.token_ids for c in make_engine(tiny_models[0], "none", k=0, num_blocks=256).generate(spec()).values()]
    engine = make_engine(tiny_models[0], f"eagle:{tmp_path}", k=3, num_blocks=256)
    assert [c.token_ids for c in engine.generate(spec()).values()] == expected


def test_bad_head_paths_name_the_flag(tiny_models, tmp_path):
    with pytest.raises(ModelLoadError, match="eagle:.*config.json"):
        make_engine(tiny_models[0], f"eagle:{tmp_path}", k=2)
    other = load_model(tiny_models[0], CPU, torch.float32).shape
    config, weights = random_eagle_head(other, seed=1)
    config.vocab_size = 500
    save_eagle_head(tmp_path / "wrong", config, weights)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        make_engine(tiny_models[0], f"eagle:{tmp_path / 'wrong'}", k=2)


@pytest.mark.slow
def test_greedy_with_head_in_every_schedule(tiny_models, heads):
    """Pipelined (pdv) steps draft one group beside the other's verify: features still line up."""
    from engine_cases import SCHEDULES, drive, specs

    expected = {r: c.token_ids for r, c in make_engine(tiny_models[0], "none", k=0).generate(specs()).items()}
    for schedule, pipeline in SCHEDULES:
        tokens, _ = drive(make_engine(tiny_models[0], heads["small_vocab"], k=4), specs(), schedule, pipeline)
        assert tokens == expected, (schedule, pipeline)


@pytest.mark.slow
def test_split_lanes_refuse_feature_drafts(heads):
    from verifypd.engine import EngineOptions
    from verifypd.lanes.rpc.lane_setup import load_lane_models

    for draft in (heads["full"], heads["full"].replace("eagle:", "eagle+ngram:", 1)):
        with pytest.raises(ModelLoadError, match="co-located only"):
            load_lane_models(EngineOptions(target="random:tinyllama-1.1b", draft=draft), True, True)
