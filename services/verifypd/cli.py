"""The `verifypd` command line.

verifypd generate --offline "PROMPT" [--target M] [--draft M] [--k N | --no-speculation] ...
verifypd generate --server HOST:PORT "PROMPT" ...      (services)
verifypd serve ... / verifypd lane prefill|draft|verify ... (services)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from verifypd.cli_flags import (
    add_model_flags,
    add_prefix_cache_flag,
    add_sampling_flags,
    add_schedule_flags,
    draft_arg,
    schedule_changes,
)
from verifypd.domain.requests import InvalidRequest, RequestSpec, SamplingParams


def _request_spec(args, codec) -> RequestSpec:
    if args.no_speculation:
        max_k = 0
    else:
        max_k = args.k
    text = args.prompt
    if text == "":
        raise InvalidRequest("prompt is empty: give some text")
    ids = (
        codec.encode_chat([{"role": "user", "content": text}])
        if (codec.has_chat_template and not args.raw)
        else codec.encode(text)
    )
    return RequestSpec(
        prompt_ids=tuple(ids),
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        max_k=max_k,
        sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
    )


def cmd_generate_offline(args) -> int:
    from verifypd.domain.config import RuntimeConfig
    from verifypd.engine import Engine, EngineOptions

    k = 0 if args.no_speculation else args.k
    if k is not None and k < 0:
        raise InvalidRequest(f"--k must be >= 0, got {k}")
    config = (
        RuntimeConfig(**schedule_changes(args))
        if k is None
        else RuntimeConfig(k_min=0, k_max=max(k, 0), k_initial=k, adaptive=False, **schedule_changes(args))
    )
    options = EngineOptions(
        target=args.target,
        draft=draft_arg(args),
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_blocks=args.num_blocks,
        config=config,
        tensor_parallel=args.tensor_parallel,
        tp_all_reduce=args.tp_all_reduce,
        prefix_cache=not args.no_prefix_cache,
    )
    SamplingParams(args.temperature, args.top_p, args.top_k, args.seed).validate()
    if args.max_tokens <= 0:
        raise InvalidRequest(f"--max-tokens must be >= 1, got {args.max_tokens}")
    engine = Engine(options)
    spec = _request_spec(args, engine.codec)
    router = engine.router
    rid = router.add_request(spec)
    text, ids, last = [], [], None
    while router.has_work():
        for out in router.step():
            ids += out.token_ids
            text.append(out.text)
            if not args.json:
                print(out.text, end="", flush=True)
            last = out
    if last is None:
        raise RuntimeError(f"request {rid!r} produced no output")
    stats = last.stats
    if args.json:
        if last.finish_reason is None:
            raise RuntimeError(f"request {rid!r} ended without a finish reason")
        print(
            json.dumps(
                {
                    "request_id": rid,
                    "text": "".join(text),
                    "token_ids": ids,
                    "finish_reason": last.finish_reason.value,
                    "usage": stats.usage(),
                    "ttft_s": stats.ttft,
                    "target": args.target,
                    "draft": options.draft,
                    "device": str(engine.models.device),
                }
            )
        )
    else:
        elapsed = (stats.token_times[-1] - stats.arrival_time) if stats.token_times else 0.0
        acc = stats.acceptance_rate
        # No draft token at all: speculation was off, or the draft (e.g. ngram: no match) proposed none.
        nothing = "speculation off" if k == 0 or options.draft == "none" else "no draft proposed"
        rate = f"{stats.completion_tokens / max(elapsed, 1e-9):.1f} tok/s"
        ttft = "?" if stats.ttft is None else f"{stats.ttft * 1000:.0f}"  # None: no token came
        print(
            f"\n[{stats.completion_tokens} tokens, acceptance {acc:.0%}, TTFT {ttft} ms, {rate}]"
            if acc is not None
            else f"\n[{stats.completion_tokens} tokens, {nothing}, {rate}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verifypd", description="Speculative-decoding LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--offline", action="store_true", help="run the engine in this process")
    where.add_argument("--server", metavar="HOST:PORT", help="send the prompt to a running verifypd server")
    add_sampling_flags(gen)
    add_model_flags(gen)
    add_schedule_flags(gen)
    add_prefix_cache_flag(gen)
    from verifypd.distill import cli as distill_cli

    distill_cli.register(sub)
    try:  # the services layer registers serve / lane / remote generate when present
        from verifypd.launch import cli as launch_cli

        launch_cli.register(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    from verifypd.domain.models import ModelLoadError

    try:
        if args.command == "generate" and args.offline:
            return cmd_generate_offline(args)
        return args.handler(args)
    except (InvalidRequest, ModelLoadError) as exc:
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
