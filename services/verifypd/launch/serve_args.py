"""The arguments of `verifypd serve` and `verifypd lane` and what they resolve to: EngineOptions (a
lane, the stack of a serve) and CoreOptions (what the gateway process hands its engine-core
process, verifypd.core.process). Torch-free; imports nothing of the serving rooms.
"""

from __future__ import annotations

import argparse
import os

from verifypd.cli_flags import add_model_flags, add_prefix_cache_flag, add_schedule_flags, draft_arg, schedule_changes
from verifypd.domain.config import RuntimeConfig
from verifypd.domain.options import KV_TRANSPORTS, CoreOptions, EngineOptions, LaneTlsFiles
from verifypd.launch.lane_devices import parse_lane_devices
from verifypd.net.auth import ADMIN_KEY_ENV, API_KEY_ENV, LANE_SECRET_ENV, load_secret
from verifypd.net.limits import DEFAULT_IDLE_TIMEOUT_S

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_HOST = os.environ.get("VERIFYPD_HOST", "127.0.0.1")


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default=DEFAULT_HOST, help="bind address (default 127.0.0.1, env VERIFYPD_HOST)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="OpenAI-compatible HTTP API, /health and /metrics on --host (default 8000; 0 = off)",
    )
    serve.add_argument(
        "--http-max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger HTTP request bodies get 413"
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines as text (default) or one JSON object each (request_id, trace_id, lane, reason "
        "fields); also $VERIFYPD_LOG_FORMAT, inherited by the engine core and the lanes",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="one log line per request the engine took (logger verifypd.access: api, request_id, "
        "trace_id, outcome, tokens, duration); off by default",
    )
    serve.add_argument(
        "--trace-sample-ratio",
        type=acceptance_rate,
        default=None,
        metavar="RATIO",
        help="with OTLP traces on: the share of new traces recorded (0..1, by trace id; a caller's "
        "sampled traceparent is followed as OpenTelemetry's parentbased_traceidratio does); default: "
        "OTEL_TRACES_SAMPLER, else all",
    )
    serve.add_argument("--served-model-name", default=None, help="the HTTP API's model id (default: the --target spec)")
    serve.add_argument(
        "--tool-parser",
        choices=["auto", "hermes", "llama3"],
        default="auto",
        help="the format of tool calls in the output (auto: from the chat template; docs/structured_output.md 'Tools')",
    )
    serve.add_argument(
        "--topology",
        choices=["colocated", "split"],
        default="colocated",
        help="colocated: lanes in this process; split: each lane its own process",
    )
    add_model_flags(serve)
    add_engine_flags(serve)
    add_prefix_cache_flag(serve)
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests before RESOURCE_EXHAUSTED")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="when a request sends max_tokens 0")
    serve.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="off",
        help="split on CUDA: run the lanes it starts under a private CUDA MPS daemon, so their "
        "kernels share the GPU instead of time-slicing (auto: where MPS can run; "
        "docs/services.md 'MPS')",
    )
    serve.add_argument(
        "--kv-transport",
        choices=KV_TRANSPORTS,
        default="auto",
        help="split: import co-located pools (handle), copy each layer's KV into a pool on another GPU of "
        "this host (peer: CUDA IPC over NVLink/PCIe, from a staging pool as large as the owner's), write "
        "it straight into that pool (direct: no staging) or stream KV bytes over gRPC (copy); auto: handle "
        "on one GPU, peer across GPUs that can reach each other (direct where the staging pool would not "
        "fit), else copy",
    )
    serve.add_argument(
        "--lane-devices",
        type=parse_lane_devices,
        default={},
        metavar="LANE=DEVICE,...",
        help="split: a device per lane process, e.g. prefill=cuda:0,verify=cuda:1,draft=cuda:1 (a bare "
        "index means cuda:N); lanes not named run on --device (docs/services.md 'Disaggregation')",
    )
    for lane in ("prefill", "draft", "verify"):
        serve.add_argument(
            f"--{lane}-addr",
            metavar="HOST:PORT",
            default=None,
            help=f"connect to a running {lane} lane instead of starting one",
        )
    serve.add_argument("--lane-timeout", type=float, default=60.0, help="seconds per lane call")
    serve.add_argument(
        "--lane-secret-file",
        default=None,
        help=f"with --*-addr: file holding the lanes' shared secret (else env {LANE_SECRET_ENV})",
    )
    serve.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for a failed lane to serve again before failing its requests",
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="health turns NOT_SERVING while one engine step has run longer than this (seconds; a "
        "slow or hung lane): new requests wait for it instead of being admitted",
    )
    serve.add_argument(
        "--max-lane-restarts",
        type=int,
        default=5,
        help="split: restarts of one lane within 60 s before it counts as a crash loop",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        help=f"file holding the key that Generate and Control.GetConfig require as `authorization: Bearer "
        f"KEY` (first line; else env {API_KEY_ENV})",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="the same key on the command line: visible to every user of the machine (ps, /proc); prefer "
        "--api-key-file",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections per public port (HTTP, gRPC); more are closed at once (default: what the "
        "open-file limit allows, split between the ports)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a new connection may take to send its first request (HTTP) or finish its handshake "
        "(gRPC) before it is closed",
    )
    serve.add_argument(
        "--admin-key-file",
        default=None,
        help=f"file holding the admin key that Control.UpdateConfig requires (else env {ADMIN_KEY_ENV}); "
        "without one, runtime config changes are refused (docs/services.md 'Access')",
    )
    serve.add_argument(
        "--tls-cert-file",
        default=None,
        help="PEM certificate (chain) of the gRPC and HTTP ports: both serve TLS only (with --tls-key-file)",
    )
    serve.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    serve.add_argument(
        "--tls-client-ca-file",
        default=None,
        help="PEM CA: clients must present a certificate it signed (mutual TLS) on both ports",
    )
    add_lane_tls_arguments(serve)
    add_health_port_argument(serve)
    serve.add_argument("--k-min", type=int, default=None)
    serve.add_argument("--k-max", type=int, default=None)
    serve.add_argument("--k-initial", type=int, default=None)
    serve.add_argument("--no-adaptive", action="store_true", help="every request uses k-initial")
    serve.add_argument("--prefill-token-budget", type=int, default=None)
    add_schedule_flags(serve)


def add_lane_arguments(lane: argparse.ArgumentParser) -> None:
    lane.add_argument("lane", choices=["prefill", "draft", "verify"])
    lane.add_argument("--host", default=DEFAULT_HOST)
    lane.add_argument("--port", type=int, default=0, help="0 = any free port (see --port-file)")
    lane.add_argument("--port-file", default=None, help="write the bound port here once serving")
    lane.add_argument(
        "--call-port",
        type=int,
        default=0,
        help="TCP port of the call channel, the router's fast path for work calls (0 = any free "
        "port, announced by Describe; -1 = none: work calls over gRPC only)",
    )
    lane.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    lane.add_argument(
        "--secret-file",
        default=None,
        help=f"file holding the secret every caller must present (else env {LANE_SECRET_ENV})",
    )
    lane.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without a secret: anyone reaching the port can read and write KV (tests only)",
    )
    lane.add_argument(
        "--tls-cert-file",
        default=None,
        help="PEM certificate this lane serves with and presents on its KV pushes (mutual TLS, "
        "with --tls-key-file and --tls-ca-file): its gRPC and call-channel ports speak TLS only",
    )
    lane.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    lane.add_argument(
        "--tls-ca-file", default=None, help="PEM CA every caller's certificate (and every KV owner's) must chain to"
    )
    lane.add_argument(
        "--tls-server-name",
        default=None,
        help="name checked in the owners' certificates on KV pushes (default: their host)",
    )
    lane.add_argument(
        "--device-lanes",
        type=int,
        default=3,
        help="lane processes sharing this lane's GPU: its KV pool takes 1/N of the free memory "
        "(default 3: prefill, draft and verify on one GPU; serve --lane-devices sets it)",
    )
    add_health_port_argument(lane)
    add_model_flags(lane)
    add_engine_flags(lane, router=False)


def add_lane_tls_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve`'s side of mutual TLS to the lanes (docs/services.md "TLS")."""
    serve.add_argument(
        "--lane-tls-cert-file",
        default=None,
        help="split: PEM certificate the engine core presents to the lanes (mutual TLS, with "
        "--lane-tls-key-file and --lane-tls-ca-file); lanes this serve starts get the same files",
    )
    serve.add_argument("--lane-tls-key-file", default=None, help="PEM private key of --lane-tls-cert-file")
    serve.add_argument("--lane-tls-ca-file", default=None, help="PEM CA the lanes' certificates must chain to")
    serve.add_argument(
        "--lane-tls-server-name",
        default=None,
        help="name checked in the lanes' certificates (default: the host of each --*-addr)",
    )


def add_health_port_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="plaintext HTTP `GET /health` (200 serving, 503 not) on --host for probes that cannot "
        "speak TLS, e.g. the kubelet's (0 = off)",
    )


def lane_tls_files(args) -> LaneTlsFiles:
    return LaneTlsFiles(
        args.lane_tls_cert_file, args.lane_tls_key_file, args.lane_tls_ca_file, args.lane_tls_server_name
    )


def serve_lane_tls(args):
    """`serve`'s --lane-tls-* flags, checked (verifypd.net.tls.TlsError naming the flag); None when not given."""
    from verifypd.net.lane_tls import serve_lane_tls as load

    return load(lane_tls_files(args))


def add_client_tls_arguments(p: argparse.ArgumentParser, what: str = "the server") -> None:
    """A client's TLS flags (`generate --server`; loadgen has the same names)."""
    p.add_argument("--tls-ca-file", default=None, help=f"PEM CA that {what}'s certificate must chain to: speak TLS")
    p.add_argument("--tls-cert-file", default=None, help="with --tls-ca-file: client certificate (PEM) to present")
    p.add_argument("--tls-key-file", default=None, help="the private key of --tls-cert-file")


def serve_parser() -> argparse.ArgumentParser:
    """`serve`'s arguments alone."""
    parser = argparse.ArgumentParser(prog="verifypd serve")
    add_serve_arguments(parser)
    return parser


def add_engine_flags(p: argparse.ArgumentParser, router: bool = True) -> None:
    p.add_argument("--block-size", type=int, default=16, help="token positions per KV block")
    p.add_argument("--max-context", type=int, default=4096, help="longest prompt + completion")
    p.add_argument(
        "--graph-buckets",
        type=_buckets,
        default=None,
        metavar="B,B,...",
        help="on CUDA: batch sizes to capture CUDA graphs for at start-up (default 1,2,4,...,256)",
    )
    if router:
        p.add_argument("--max-running", type=int, default=256, help="requests decoding at once")
    else:
        p.add_argument(
            "--k-max",
            type=int,
            default=None,
            help="longest draft the router will ask for (sizes the graphs captured at start-up)",
        )
    p.add_argument(
        "--simulated-acceptance",
        type=acceptance_rate,
        default=None,
        metavar="ALPHA",
        help="BENCHMARK ONLY: real draft and verify compute, but each draft token is accepted with "
        "probability ALPHA (0..1, seeded); outputs are NOT the target model's",
    )


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated batch sizes, got {text!r}") from None
    if not values or values[0] < 1 or values[-1] > 4096:
        raise argparse.ArgumentTypeError(f"batch sizes must be in [1, 4096], got {text!r}")
    return values


def acceptance_rate(text: str) -> float:
    """--simulated-acceptance, --trace-sample-ratio: a probability in [0, 1] (argparse reports the
    error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (a probability), got {text}")
    return value


def engine_options(args):
    options = EngineOptions(
        target=args.target,
        draft=draft_arg(args),
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_context=args.max_context,
        graph_buckets=args.graph_buckets,
        tensor_parallel=args.tensor_parallel,
        tp_all_reduce=args.tp_all_reduce,
        simulated_acceptance=getattr(args, "simulated_acceptance", None),
        prefix_cache=not getattr(args, "no_prefix_cache", False),
        lane_devices=dict(getattr(args, "lane_devices", None) or {}),
        device_lanes=getattr(args, "device_lanes", 3),
    )
    if getattr(args, "k_max", None) is not None and not hasattr(args, "max_running"):  # a lane process
        options.config = RuntimeConfig(
            k_min=0, k_initial=min(RuntimeConfig().k_initial, max(args.k_max, 0)), k_max=args.k_max
        )
        options.config.validate()  # InvalidRequest names the bound
    if hasattr(args, "max_running"):
        options.max_running = args.max_running
        changes = {
            name: getattr(args, name)
            for name in ("k_min", "k_max", "k_initial", "prefill_token_budget")
            if getattr(args, name) is not None
        }
        if args.no_adaptive:
            changes["adaptive"] = False
        changes.update(
            schedule_changes(
                args, split=getattr(args, "topology", "colocated") == "split", drafting=options.draft != "none"
            )
        )
        options.config = RuntimeConfig(**changes) if changes else RuntimeConfig()
        options.config.validate()
    return options


def lane_addrs(args) -> dict[str, str]:
    """`serve`'s --*-addr flags that were given (lane -> HOST:PORT)."""
    return {lane: addr for lane in ("prefill", "draft", "verify") if (addr := getattr(args, f"{lane}_addr"))}


def core_options(args, engine: EngineOptions | None = None) -> CoreOptions:
    """`serve`'s arguments resolved for the engine-core process. The lane secret of --*-addr lanes
    is read here (--lane-secret-file, else its environment variable: OSError / ValueError), so the
    core gets it in its options on a pipe, never on a command line."""
    addrs = lane_addrs(args)
    return CoreOptions(
        engine=engine if engine is not None else engine_options(args),
        topology=args.topology,
        lane_addrs=addrs,
        lane_secret=load_secret(args.lane_secret_file) if addrs else None,
        lane_tls=lane_tls_files(args),
        kv_transport=args.kv_transport,
        lane_timeout_s=args.lane_timeout,
        recovery_timeout_s=args.recovery_timeout,
        stall_timeout_s=args.stall_timeout,
        max_lane_restarts=args.max_lane_restarts,
        max_queue=args.max_queue,
        mps=args.mps,
        metrics=bool(args.http_port),
        model_name=args.served_model_name or "",
    )
