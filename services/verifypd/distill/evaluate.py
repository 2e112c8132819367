"""Real acceptance of drafts on held-out prompts: the engine at temperature 0 with a fixed k, per
draft and per prompt family: mean tokens per verify step (accepted drafts + 1) and tokens/s."""

from __future__ import annotations

import json
import pathlib
import time
from collections import defaultdict

from verifypd.distill.data import encode, read_prompts


def prompt_families(path: str) -> list[str]:
    """The "family" of each JSONL prompt line ("all" where none is given), in read_prompts' order."""
    families = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            families.append(json.loads(line).get("family", "all") if line.startswith("{") else "all")
    return families


def compare_drafts(
    target: str,
    drafts: list[str],
    prompts_file: str,
    *,
    k: int,
    max_tokens: int,
    device: str = "auto",
    dtype: str = "auto",
) -> dict:
    from verifypd.domain.config import RuntimeConfig
    from verifypd.domain.models import draft_spec
    from verifypd.domain.requests import RequestSpec
    from verifypd.engine import Engine, EngineOptions
    from verifypd.model.build import load_draft_model, load_models

    prompts, families = read_prompts(prompts_file), prompt_families(prompts_file)
    results = []
    models = None
    for draft in drafts:
        options = EngineOptions(
            target=target,
            draft=draft,
            device=device,
            dtype=dtype,
            config=RuntimeConfig(k_min=0, k_max=k, k_initial=k, adaptive=False),
        )
        if models is None:
            models = load_models(options)
        models.draft_model = load_draft_model(
            draft_spec(draft), models.target, models.device, models.dtype, options.max_context
        )
        models.draft_name = draft
        models.target_model.features = None  # a feature pool of an earlier engine must not linger
        engine = Engine(options, models=models)
        ids = [encode(engine.codec, p) for p in prompts]
        t0 = time.monotonic()
        done = engine.generate(
            [RequestSpec(tuple(p), max_tokens=max_tokens, request_id=f"e{i}") for i, p in enumerate(ids)]
        )
        seconds = time.monotonic() - t0
        per_family: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # accepted, verify steps, tokens
        for i, family in enumerate(families):
            usage = done[f"e{i}"].usage
            for key in (family, "all") if family != "all" else ("all",):
                row = per_family[key]
                row[0] += usage.get("accepted_tokens", 0)
                row[1] += usage.get("verify_steps", 0)
                row[2] += len(done[f"e{i}"].token_ids)
        results.append(
            {
                "draft": draft,
                "k": k,
                "seconds": round(seconds, 2),
                "tokens_per_s": round(per_family["all"][2] / max(seconds, 1e-9), 1),
                "tokens_per_verify_step": (per_family["all"][0] + per_family["all"][1]) / max(per_family["all"][1], 1),
                "families": {
                    f: {"tokens_per_verify_step": (a + s) / max(s, 1), "verify_steps": s}
                    for f, (a, s, _) in sorted(per_family.items())
                },
            }
        )
    return {"target": target, "prompts": prompts_file, "temperature": 0, "max_tokens": max_tokens, "drafts": results}
