"""`verifypd distill` for the families beyond Llama: a few training steps on a tiny checkpoint of each
kind of layer stack (every layer windowed: Mistral; local + global layers with soft caps: Gemma 2;
experts: Mixtral; q/k norms: Qwen3) write a head that loads as `--draft eagle:DIR` and drafts
losslessly (greedy output equal to no speculation). What docs/draft_heads.md promises."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine, write_tiny_llama
from family_checkpoints import write_family, write_tiny_moe

from verifypd.cli import main
from verifypd.domain.requests import RequestSpec

pytestmark = pytest.mark.slow  # distillation training
TINY = ["--samples", "12", "--gen-tokens", "8", "--batch-tokens", "256", "--steps", "3", "--device", "cpu"]


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3", "mixtral"])
def test_distilled_head_of_each_family_drafts_losslessly(family, tmp_path):
    if family == "mixtral":
        target = write_tiny_moe(tmp_path / family, family, write_tiny_llama(tmp_path / "tok", seed=0, layers=1), seed=4)
    else:
        target = write_family(tmp_path / family, family, seed=2)
    out = tmp_path / "head"
    assert main(["distill", "--target", str(target), "--out", str(out), "--no-progress", *TINY]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    prompts = [(5, 9, 14, 3, 22, 7, 31, 12, 40), (8, 8, 17, 25, 4, 19, 30, 11, 6, 2, 13)]
    outputs = {}
    for draft, k in (("none", 0), (f"eagle:{out}", 3)):
        done = make_engine(str(target), draft, k=k, max_context=64).generate(
            [RequestSpec(p, max_tokens=10, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
        )
        outputs[k] = [done[str(i)].token_ids for i in range(len(prompts))]
    assert outputs[3] == outputs[0]
