"""Where a decode step's time goes on the GPU: a torch.profiler trace of one family's requests through
`bench/drafts/draft_acceptance.py`'s engines, summarised as the GPU's busy time (the union of its kernels and
copies), its idle gaps, and the host's CUDA API calls (graph launches, waits), per draft.

    python bench/engine/step_trace.py --target GGUF --drafts eagle:DIR,eagle:DIR#no-ahead,none --batch 16 --out DIR

Draft names take draft_acceptance's suffixes (#no-ahead, #no-draft-after). Writes DIR/step_trace.json
and each draft's Chrome trace (DIR/trace_*.json.gz). Figures: bench/results/step_trace_h200.json.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafts"))  # draft_acceptance
import draft_acceptance as da

from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.model.loader import load_model


def summarise(events: list[dict]) -> dict:
    """GPU busy / idle from the kernels' and copies' intervals; host CUDA API time by call name."""
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    busy, gaps, (start, end) = 0.0, [], spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, gaps, (start, end) = busy + end - start, gaps + [s - end], (s, e)
        else:
            end = max(end, e)
    busy += end - start
    calls: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            c = calls.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e["dur"]
    top = sorted(calls.items(), key=lambda x: -x[1][1])[:10]
    return {
        "gpu_span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 2),
        "gpu_busy_ms": round(busy / 1e3, 2),
        "gpu_ops": len(spans),
        "idle_ms_in_gaps_over_5us": round(sum(g for g in gaps if g > 5) / 1e3, 2),
        "idle_ms_in_gaps_up_to_5us": round(sum(g for g in gaps if g <= 5) / 1e3, 2),
        "host_cuda_calls": {
            n: {"calls": c, "ms": round(d / 1e3, 2), "us_per_call": round(d / c, 1)} for n, (c, d) in top
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the embedded model's GGUF")
    ap.add_argument("--drafts", default="none")
    ap.add_argument("--family", default="extract", help="a family of bench/prompts/draft_acceptance.jsonl")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="fixed k (so that every run drafts alike)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default="step_trace")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    target = load_model(args.target, device, dtype, 2048)
    codec = TextCodec(target.tokenizer)
    rows = da.load_prompts(args.batch)
    prompts = {
        f: [tuple(codec.encode_chat([{"role": "user", "content": r["prompt"]}])) for r in rs] for f, rs in rows.items()
    }
    ids = prompts[args.family][: args.batch]
    results = {}
    for name in args.drafts.split(","):
        engine = da.make_engine(target, name, None if name == "none" else args.k, device, dtype)
        for fam in prompts:  # compiles and first-call allocations outside the trace
            engine.generate([RequestSpec(prompts[fam][0], max_tokens=16, request_id=f"w-{fam}")])

        def specs(tag):
            return [RequestSpec(p, max_tokens=args.max_tokens, request_id=f"{tag}-{i}") for i, p in enumerate(ids)]

        engine.generate(specs("warm"))
        t0 = time.perf_counter()
        engine.generate(specs("plain"))
        unprofiled = time.perf_counter() - t0
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            t0 = time.perf_counter()
            engine.generate(specs("traced"))
            torch.cuda.synchronize()
            profiled = time.perf_counter() - t0
        tag = name.split(":")[0] + "".join("_" + s.lstrip("#") for s in (da.NO_AHEAD, da.NO_DRAFT_AFTER) if s in name)
        path = out / f"trace_{tag}.json"
        prof.export_chrome_trace(str(path))
        summary = summarise(json.loads(path.read_text())["traceEvents"])
        with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
            g.write(f.read())
        path.unlink()
        results[name] = {"wall_ms": round(unprofiled * 1e3, 2), "wall_ms_profiled": round(profiled * 1e3, 2), **summary}
        print(name, json.dumps(results[name]), flush=True)
    json.dump(
        {
            "command": " ".join(["python"] + sys.argv),
            "git_revision": da.git_revision(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "device": torch.cuda.get_device_name(),
            "family": args.family,
            "batch": args.batch,
            "k": args.k,
            "max_tokens": args.max_tokens,
            "results": results,
        },
        open(out / "step_trace.json", "w"),
        indent=2,
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
