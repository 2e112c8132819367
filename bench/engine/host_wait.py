"""Whether a decode step waits on the GPU or on the host: each `Router.step()`'s wall time split into the
time the host spent blocked on verify results (the one host sync of a step, `HostCopy.result`) and the
rest (host work: planning, layouts, launches, commit, streaming), per draft, family and batch size,
through `bench/drafts/draft_acceptance.py`'s engines (the embedded model, its prompts).

    python bench/engine/host_wait.py --target GGUF --drafts eagle:DIR,eagle:DIR#no-fit,none --out host_wait.json

A step whose wait is near 0 is host-bound: the GPU had its work queued and idled while the host caught
up. Each run also counts its steps by kind (`step_kinds`: regular, chained plain steps launched ahead by
engine.overlap, speculative steps launched ahead by engine.spec_ahead), why plain chains ended
(`chain_breaks`: each end costs a regular step, not overlapped) and the scheduler's k decisions
(`k_decisions`: all, drafting, periodic probes). Each (draft, family, batch) runs --repeats times; all runs
are reported. Draft names take draft_acceptance's suffixes (#no-fit, #no-ahead, #no-draft-after). Batch 1
runs the family's first --solo prompts one at a time. Figures: bench/results/host_wait_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_meta
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafts"))  # draft_acceptance
import draft_acceptance as da
from bench_meta import metadata

from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.lanes import device_values
from verifypd.model.loader import load_model


class WaitClock:
    """Wraps HostCopy.result: seconds the host spent blocked on verify results, and how many waits."""

    def __init__(self):
        self.seconds, self.waits = 0.0, 0
        original = device_values.HostCopy.result
        clock = self

        def timed(copy):
            t0 = time.perf_counter()
            if copy._event is not None:
                copy._event.synchronize()
            clock.seconds += time.perf_counter() - t0
            clock.waits += 1
            return original(copy)

        device_values.HostCopy.result = timed


class CallClocks:
    """`--time-calls`: host seconds and counts of the calls a step's host time may hide a wait in, or
    spend launch overhead on: every CUDA event sync (HostCopy.result's among them), graph replays
    (cudaGraphLaunch), pinned staging takes (a take waits for the staging's previous copy, which is
    stream-ordered behind the GPU work queued before it) and Triton kernel launches."""

    def __init__(self):
        import triton

        from verifypd.model import layout

        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for name, owner, attr in (
            ("event_sync", torch.cuda.Event, "synchronize"),
            ("graph_replay", torch.cuda.CUDAGraph, "replay"),
            ("staging_take", layout.PinnedStaging, "take"),
            ("triton_launch", triton.runtime.jit.JITFunction, "run"),
        ):
            self._wrap(name, owner, attr)

    def _wrap(self, name: str, owner, attr: str) -> None:
        original, clocks = getattr(owner, attr), self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clocks.seconds[name] = clocks.seconds.get(name, 0.0) + time.perf_counter() - t0
                clocks.calls[name] = clocks.calls.get(name, 0) + 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds, self.calls = {}, {}

    def report(self) -> dict:
        return {name: {"s": round(s, 5), "calls": self.calls[name]} for name, s in self.seconds.items()}


def run(engine, specs_of, batch: int, wait: WaitClock, clocks: CallClocks | None = None) -> dict:
    router, kinds = engine.router, {"regular": 0, "chained": 0, "ahead": 0}
    step = router.step

    def counting():  # what kind of step Router.step() is about to take (its first branch)
        kind = (
            "chained"
            if router.overlap.inflight is not None
            else "ahead"
            if router.ahead.inflight is not None
            else "regular"
        )
        kinds[kind] += 1
        return step()

    router.step = counting
    wait.seconds, wait.waits = 0.0, 0
    if clocks is not None:
        clocks.reset()
    ahead0, fitted0 = router.ahead.steps, router.ahead.fitted
    breaks0, probes = dict(router.overlap.breaks), router.scheduler.probes
    decisions0 = (probes.decisions, probes.drafting, probes.probes)
    t0 = time.perf_counter()
    done = {}
    for specs in specs_of(batch):
        done.update(engine.generate(specs))
    seconds = time.perf_counter() - t0
    router.step = step
    breaks = {why: n - breaks0.get(why, 0) for why, n in router.overlap.breaks.items() if n > breaks0.get(why, 0)}
    decisions = [
        now - before
        for now, before in zip((probes.decisions, probes.drafting, probes.probes), decisions0, strict=False)
    ]
    return {
        "seconds": round(seconds, 5),
        "router_steps": sum(kinds.values()),
        "step_kinds": kinds,
        "chain_breaks": breaks,
        "k_decisions": dict(zip(("all", "drafting", "probes"), decisions, strict=False)),
        "wait_s": round(wait.seconds, 5),
        "host_s": round(seconds - wait.seconds, 5),
        "tokens": sum(c.usage["completion_tokens"] for c in done.values()),
        "verify_steps": sum(c.usage["verify_steps"] for c in done.values()),
        "accepted": sum(c.usage["accepted_tokens"] for c in done.values()),
        "steps_ahead": router.ahead.steps - ahead0,
        "verify_calls_fitted": router.ahead.fitted - fitted0,
        **({"calls": clocks.report()} if clocks is not None else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the embedded model's GGUF")
    ap.add_argument("--drafts", default="none")
    ap.add_argument("--families", default="extract,chat", help="families of bench/prompts/draft_acceptance.jsonl")
    ap.add_argument("--batches", default="16,1")
    ap.add_argument("--solo", type=int, default=4, help="prompts of a family run one at a time at batch 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="host_wait.json")
    ap.add_argument(
        "--time-calls",
        action="store_true",
        help="also time event syncs, graph replays, staging takes and Triton launches (CallClocks)",
    )
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(args.target, device, dtype, 2048)
    codec = TextCodec(target.tokenizer)
    prompts = {
        f: [tuple(codec.encode_chat([{"role": "user", "content": r["prompt"]}])) for r in rs]
        for f, rs in da.load_prompts(16).items()
    }
    families = args.families.split(",")
    unknown = [f for f in families if f not in prompts]
    if unknown:
        ap.error(f"--families: no family {unknown[0]!r} (have {', '.join(prompts)})")
    wait, results = WaitClock(), {}
    clocks = CallClocks() if args.time_calls else None
    for name in args.drafts.split(","):
        engine = da.make_engine(target, name, None, device, dtype)
        for ids in prompts.values():  # first calls and every batch size measured once, outside the timings
            engine.generate([RequestSpec(ids[0], max_tokens=16)])
            engine.generate([RequestSpec(p, max_tokens=32) for p in ids])
        for family in families:
            for batch in (int(b) for b in args.batches.split(",")):

                def specs_of(b, ids=prompts[family]):
                    if b == 1:
                        return [[RequestSpec(p, max_tokens=args.max_tokens)] for p in ids[: args.solo]]
                    return [
                        [RequestSpec(p, max_tokens=args.max_tokens) for p in ids[i : i + b]]
                        for i in range(0, len(ids), b)
                    ]

                runs = [run(engine, specs_of, batch, wait, clocks) for _ in range(args.repeats)]
                results[f"{name}|{family}|b{batch}"] = runs
                print(name, family, batch, json.dumps(runs[len(runs) // 2]), flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {**metadata(), "max_tokens": args.max_tokens, "solo_prompts": args.solo, "results": results}, f, indent=1
        )


if __name__ == "__main__":
    main()
