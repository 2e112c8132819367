"""`verifypd generate --server HOST:PORT`: one prompt sent to a running server over gRPC, streamed
or printed as one JSON object."""

from __future__ import annotations

import json
import sys
import time


def cmd_generate_remote(args) -> int:
    import grpc

    from verifypd.domain.convert import FINISH_NAMES
    from verifypd.net import tls as tls_mod
    from verifypd.v1 import generate_pb2, generate_pb2_grpc

    try:
        tls = tls_mod.client_tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except tls_mod.TlsError as exc:
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    channel = tls_mod.grpc_channel(args.server, tls)
    try:
        grpc.channel_ready_future(channel).result(timeout=5)
    except grpc.FutureTimeoutError:
        channel.close()
        print(
            f"verifypd: error: cannot reach a verifypd server at {args.server}: {tls_mod.diagnose(args.server, tls)}",
            file=sys.stderr,
        )
        return 2
    if args.api_key:
        from verifypd.net.auth import bearer_interceptor

        channel = grpc.intercept_channel(channel, bearer_interceptor(args.api_key))
    stub = generate_pb2_grpc.GenerationStub(channel)
    req = generate_pb2.GenerateRequest(
        sampling=generate_pb2.SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        ),
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    if args.no_speculation:
        req.speculation.disable = True
    elif args.k is not None:
        req.speculation.max_k = args.k
    if args.raw:
        req.text = args.prompt
    else:
        req.chat.messages.add(role="user", content=args.prompt)
    t0 = time.monotonic()
    ids, text, last, ttft = [], [], None, None
    try:
        info = stub.GetServerInfo(generate_pb2.ServerInfoRequest(), timeout=10)
        for attempt in range(2):
            try:
                for msg in stub.Generate(req, timeout=args.timeout):
                    if ttft is None and msg.token_ids:
                        ttft = time.monotonic() - t0
                    ids += msg.token_ids
                    text.append(msg.text)
                    if not args.json:
                        print(msg.text, end="", flush=True)
                    last = msg
                break
            except grpc.RpcError as exc:
                # Like the offline CLI: chat template when the model has one, else plain text.
                if (
                    attempt == 0
                    and last is None
                    and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                    and "chat template" in (exc.details() or "")
                ):
                    req.text = args.prompt
                    continue
                raise
    except grpc.RpcError as exc:
        print(f"\nverifypd: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if last is None:
        print("\nverifypd: error: the server ended the stream without a response", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - t0
    u = last.usage
    usage = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "draft_tokens": u.draft_tokens,
        "accepted_tokens": u.accepted_tokens,
        "verify_steps": u.verify_steps,
        "cached_tokens": u.cached_tokens,
    }
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": last.request_id,
                    "text": "".join(text),
                    "token_ids": ids,
                    "finish_reason": FINISH_NAMES[last.finish_reason],
                    "usage": usage,
                    "ttft_s": ttft,
                    "target": info.target_model,
                    "draft": info.draft_model,
                    "device": f"server:{args.server}",
                }
            )
        )
        return 0
    rate = u.completion_tokens / max(elapsed, 1e-9)
    off = args.no_speculation or args.k == 0 or info.draft_model == "none"
    acc = f"acceptance {u.accepted_tokens / u.draft_tokens:.0%}" if u.draft_tokens else "no draft proposed"
    acc = "speculation off" if off and not u.draft_tokens else acc
    ttft_ms = f"TTFT {ttft * 1000:.0f} ms, " if ttft is not None else ""
    print(f"\n[{u.completion_tokens} tokens, {acc}, {ttft_ms}{rate:.1f} tok/s]", file=sys.stderr)
    return 0
