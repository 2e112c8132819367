"""Grammar engines for structured output, measured on the host: llguidance vs xgrammar.

    PYTHONPATH=services python bench/serving/grammar_engines.py --out FILE [--smoke]

Over the embedded model's tokenizer (SmolLM2, 49152 tokens; `--smoke`: the same tokenizer, fewer
repetitions) and a few JSON schemas, records per engine (medians, ms):
  * tokenizer_ms: building the engine's tokenizer view (once per server)
  * compile_ms:   one schema -> a matcher ready for its first mask (per request; no cache)
  * mask_us:      one next-token bitmask fill, over a fixed accepted token sequence (per token)
  * spec_step_us: one verify step's k + 1 masks for k = 4 drafts: advance through the drafts,
                  fill each mask, roll back to the accepted prefix (the router's per-step work)
  * apply_us:     the lane's share (verifypd.model.token_mask.apply_token_mask): masking a verify
                  call's [rows, 49152] logits, rows = batch x (k + 1), on this script's device
                  (CUDA if present: host-to-device copy + unpack + masked fill, synchronized)
The token sequence is the tokenization of a valid instance, so every mask is a real mid-output one.
Host-only work (no model): the numbers are the same on the GPU machine's CPU up to its clock.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "services"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_meta import metadata  # noqa: E402

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]},
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "status": {"enum": ["open", "paid", "shipped"]},
            },
            "required": ["id", "items", "status"],
        },
        {
            "id": "ABC-1234",
            "items": [{"sku": "x-1", "qty": 2, "price": 3.5}, {"sku": "y-22", "qty": 1, "price": 10}],
            "status": "paid",
        },
    ),
}


def load_tokenizer():
    from verifypd.gateway.server import load_codec

    return load_codec("smollm2").tokenizer


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def bench_llguidance(hf, schema, tokens, reps):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    tokenizer_s = time.perf_counter() - t0
    compile_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
        lnp.fill_next_token_bitmask(m, mask)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    mask_s = []
    for _ in range(reps):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        for t in tokens:
            t0 = time.perf_counter()
            lnp.fill_next_token_bitmask(m, mask)
            mask_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    step_s = []
    masks = lnp.allocate_token_bitmask(5, tok.vocab_size)
    for _ in range(reps):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        for i in range(0, len(tokens) - 5, 2):  # accept 2 of 4 drafts each step (+1 target token)
            t0 = time.perf_counter()
            drafts = tokens[i : i + 4]
            for j, t in enumerate(drafts):
                lnp.fill_next_token_bitmask(m, masks, j)
                m.consume_token(t)
            lnp.fill_next_token_bitmask(m, masks, 4)
            m.rollback(4 - 2)
            step_s.append(time.perf_counter() - t0)
            m.consume_token(tokens[i + 2])
            m.rollback(1)  # the step's consumed prefix is the accepted one; keep the trace aligned
    return tokenizer_s, compile_s, mask_s, step_s


def bench_xgrammar(hf, schema, tokens, reps):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - t0
    compile_s = []
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    text = json.dumps(schema)
    for _ in range(reps):
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(text))
        m.fill_next_token_bitmask(mask)
        compile_s.append(time.perf_counter() - t0)
    compiled = compiler.compile_json_schema(text)
    mask_s = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            mask_s.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    step_s = []
    masks = torch.full((5, mask.shape[1]), -1, dtype=torch.int32)
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        for i in range(0, len(tokens) - 5, 2):
            t0 = time.perf_counter()
            for j, t in enumerate(tokens[i : i + 4]):
                m.fill_next_token_bitmask(masks, j)
                m.accept_token(t)
            m.fill_next_token_bitmask(masks, 4)
            m.rollback(2)
            step_s.append(time.perf_counter() - t0)
            m.accept_token(tokens[i + 2])
            m.rollback(1)
    return tokenizer_s, compile_s, mask_s, step_s


def bench_apply(vocab: int, reps: int) -> dict:
    import numpy as np
    import torch

    from verifypd.model.token_mask import apply_token_mask

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for batch, k in ((1, 4), (32, 4)):
        rows = batch * (k + 1)
        logits = torch.randn(rows, vocab, device=device)
        masks = np.random.default_rng(0).integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int32)
        samples = []
        for _ in range(reps * 5):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            apply_token_mask(logits, masks)
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        out[f"batch{batch}_k{k}"] = round(statistics.median(samples) * 1e6, 1)
    return {"device": device, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="few repetitions (a CPU check of the script)")
    args = ap.parse_args()
    reps = 2 if args.smoke else 10
    hf = load_tokenizer()
    result: dict = {**metadata(), "tokenizer": "SmolLM2-135M (embedded)", "vocab": len(hf), "reps": reps}
    engines: dict = {}
    for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            __import__(engine)
            version = importlib.metadata.version(engine)
        except ImportError as exc:
            engines[engine] = {"error": f"not installed: {exc}"}
            continue
        per_schema = {}
        for name, (schema, instance) in SCHEMAS.items():
            tokens = hf(json.dumps(instance), add_special_tokens=False)["input_ids"]
            tokenizer_s, compile_s, mask_s, step_s = fn(hf, schema, tokens, reps)
            per_schema[name] = {
                "tokens": len(tokens),
                "tokenizer_ms": round(tokenizer_s * 1e3, 1),
                "compile_ms": median_ms(compile_s),
                "mask_us": round(statistics.median(mask_s) * 1e6, 1),
                "mask_p90_us": round(sorted(mask_s)[int(0.9 * len(mask_s))] * 1e6, 1),
                "spec_step_k4_us": round(statistics.median(step_s) * 1e6, 1),
            }
        engines[engine] = {"version": version, "schemas": per_schema}
    result["engines"] = engines
    result["apply_us"] = bench_apply(len(hf), reps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(engines, indent=1))


if __name__ == "__main__":
    main()
