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

    if args.draft_tree is not None:
        return cmd_generate_tree(args)
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


def cmd_generate_tree(args) -> int:
    """`generate --offline --draft-tree ...`: draft trees through spec_decode.tree_decode (offline only;
    greedy or seeded, stops at EOS; no stop strings or the router's other request features)."""
    from verifypd.domain.draft_tree import parse_tree_shape
    from verifypd.domain.options import EngineOptions
    from verifypd.domain.tokenizer import TextCodec
    from verifypd.model.build import load_models
    from verifypd.spec_decode.tree_decode import TreeDecoder

    shape = parse_tree_shape(args.draft_tree)
    if args.no_speculation or args.k is not None:
        raise InvalidRequest("--draft-tree drafts trees: leave out --k and --no-speculation")
    if args.tensor_parallel != 1:
        raise InvalidRequest("--draft-tree runs on a single-process target: leave out --tensor-parallel")
    if args.stop:
        raise InvalidRequest("--draft-tree takes no --stop strings yet")
    if args.max_tokens <= 0:
        raise InvalidRequest(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    sampling.validate()
    options = EngineOptions(
        target=args.target, draft=draft_arg(args), device=args.device, dtype=args.dtype, quantization=args.quantization
    )
    models = load_models(options)
    codec = TextCodec(models.target.tokenizer)
    spec = _request_spec(args, codec)
    try:
        decoder = TreeDecoder(models, shape, max_context=len(spec.prompt_ids) + args.max_tokens, num_blocks=0)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    eos = frozenset(models.target.eos_token_ids)
    [ids], stats = decoder.generate([list(spec.prompt_ids)], args.max_tokens, sampling, stop_ids=eos)
    text = codec.decode(ids)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": ids,
                    "verify_steps": stats.steps,
                    "tokens_per_step": stats.tokens_per_step,
                    "draft_tree": args.draft_tree,
                    "target": args.target,
                    "draft": options.draft,
                    "device": str(models.device),
                }
            )
        )
    else:
        print(text)
        rate = len(ids) / max(stats.seconds, 1e-9)
        print(f"[{len(ids)} tokens, {stats.tokens_per_step:.2f} per verify step, {rate:.1f} tok/s]", file=sys.stderr)
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
    gen.add_argument(
        "--draft-tree",
        metavar="topk=K,budget=N,depth=D",
        default=None,
        help="draft EAGLE-2-style trees instead of chains (--offline only; an eagle: head, self:N or a "
        "draft model): K best children per expansion, D expansions, cut to the N likeliest nodes "
        "(N <= 63); e.g. topk=4,budget=32,depth=6. Off by default (chains) until measured",
    )
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
        if getattr(args, "draft_tree", None) is not None:
            raise InvalidRequest("--draft-tree runs with --offline only: the server drafts chains")
        return args.handler(args)
    except (InvalidRequest, ModelLoadError) as exc:
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
