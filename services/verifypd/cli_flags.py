"""Command-line flags shared by `verifypd generate` (cli.py) and `verifypd serve`/`lane`
(launch/serve_args.py), and what they resolve to. Imports nothing of the serving rooms."""

from __future__ import annotations

import argparse


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--k", type=int, default=None, help="draft tokens per verify step (fixed; default: adaptive)")
    spec.add_argument(
        "--no-speculation", action="store_true", help="plain decoding (k = 0); loads no draft (any --draft is ignored)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text even if the model has a chat template"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    from verifypd.domain.defaults import DEFAULT_TARGET
    from verifypd.domain.drafts import DRAFT_HELP
    from verifypd.domain.options import KV_CACHE_DTYPES, QUANTIZATIONS

    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target model: local dir, .gguf file, HF cache name, or 'smollm2' (embedded, default)",
    )
    # None = not given: resolved by draft_arg() (the default, or none with --no-speculation).
    p.add_argument("--draft", default=None, help=DRAFT_HELP)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: quantize the target's attention and MLP projections to fp8 (per output channel) while "
        "loading; activations are quantized per token (embeddings, norms and lm_head stay in --dtype). "
        "Published FP8 checkpoints (compressed-tensors, fbgemm_fp8) load as fp8 without it",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV pools' element type: auto (default) = --dtype; fp8 = float8_e4m3fn, half the bytes of "
        "bf16 a token, so about twice the tokens in the same memory (static scale 1.0, saturating; "
        "GPUs of compute capability 8.9+, or the CPU)",
    )
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per pool (default: from memory)")
    p.add_argument(
        "--tensor-parallel",
        type=tensor_parallel_size,
        default=1,
        metavar="N",
        help="shard the target over N processes, one GPU each (cuda:I..cuda:I+N-1 from --device "
        "cuda:I; gloo on --device cpu); N must divide its heads, kv heads and intermediate size",
    )
    p.add_argument(
        "--tp-all-reduce",
        choices=("auto", "custom", "nccl"),
        default="auto",
        help="the ranks' all-reduce: custom = one-shot/two-shot kernel over peer-mapped GPU buffers "
        "(NCCL for large messages); nccl = NCCL only; auto (default) = custom where every GPU can "
        "access the others' memory, else NCCL",
    )


def tensor_parallel_size(text: str) -> int:
    """--tensor-parallel: an integer >= 1 (argparse reports the error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_schedule_flags(p: argparse.ArgumentParser) -> None:
    from verifypd.domain.config import SCHEDULES

    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="pdv",
        help="router policy (docs/engine.md 'Schedules'): baseline = one request per lane call; "
        "pd = prefill + lock-step draft/verify; pdv = prefill, draft and verify lanes with "
        "one group's draft overlapping the other's verify (default)",
    )
    p.add_argument(
        "--pipeline",
        choices=("auto", "on", "off"),
        default="auto",
        help="pdv: overlap one group's draft with the other's verify, where it measures faster "
        "than lock-step. auto (default): on when the lanes are separate processes (serve "
        "--topology split), off in one process, where it measured slower at high concurrency "
        "on an H200 (docs/engine.md 'Schedules')",
    )

    p.add_argument(
        "--overlap",
        choices=("on", "off", "ahead"),
        default="on",
        help="overlapped plain decoding: launch the next k = 0 step while the current one runs "
        "on the GPU (default on; in-process lanes only; docs/engine.md 'Overlapped scheduling'). "
        "ahead: on, and a request admitted into a chained step is prefilled ahead of it and "
        "decodes in it (its first token one step sooner; not yet measured served on a GPU)",
    )


def add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn automatic prefix caching off: every prompt is prefilled in full (default on; "
        "the split topology serves without it; docs/engine.md 'Prefix caching')",
    )


def schedule_changes(args, split: bool = False, drafting: bool = True) -> dict:
    """RuntimeConfig fields of --schedule / --pipeline; `split`: the lanes are separate processes;
    `drafting`: a draft is loaded. Without one there is no draft call to overlap, and two groups
    only halve each verify call's batch (measured on an H200: split serving with --draft none at
    0.53 x colocated with the pipeline on), so auto is off then."""
    auto = split and drafting
    return {
        "schedule": args.schedule,
        "pipeline": args.pipeline == "on" or (args.pipeline == "auto" and auto),
        "overlap": args.overlap != "off",
        "admit_ahead": args.overlap == "ahead",
    }


def draft_arg(args) -> str:
    """The draft to load for these arguments (see verifypd.domain.drafts.resolve_draft)."""
    from verifypd.domain.defaults import DEFAULT_TARGET
    from verifypd.domain.drafts import resolve_draft

    no_speculation = getattr(args, "no_speculation", False)
    if args.draft is not None or no_speculation:
        return resolve_draft(args.draft, no_speculation)
    device = getattr(args, "device", "auto") or "auto"
    gpu = device.startswith("cuda")
    if device == "auto":
        import torch  # the default depends on the device "auto" resolves to

        gpu = torch.cuda.is_available()
    return resolve_draft(None, target=getattr(args, "target", None) or DEFAULT_TARGET, gpu=gpu)
