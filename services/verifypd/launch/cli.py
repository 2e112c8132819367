"""`verifypd serve`, `verifypd lane` and `verifypd generate --server` (registered by verifypd.cli).

verifypd serve [--port 50051] [--topology colocated|split] [--target M] [--draft M]
verifypd lane prefill|draft|verify --port P [--target M] [--draft M]
verifypd generate --server HOST:PORT "PROMPT" [--json] [sampling flags]
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from verifypd.domain.heap import freeze_startup_heap
from verifypd.domain.logs import LOG_FORMAT_ENV, setup_logging, simulated_label, warn_simulated
from verifypd.launch.lane_devices import lane_devices_error
from verifypd.launch.serve_args import (
    add_client_tls_arguments,
    add_lane_arguments,
    add_serve_arguments,
    core_options,
    engine_options,
    serve_lane_tls,
)
from verifypd.net.auth import ADMIN_KEY_ENV, API_KEY_ENV, LANE_SECRET_ENV


def register(sub) -> None:
    sub.choices["generate"].set_defaults(handler=cmd_generate_remote)
    sub.choices["generate"].add_argument(
        "--timeout", type=float, default=None, help="with --server: deadline for the whole generation, seconds"
    )
    sub.choices["generate"].add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"with --server: the server's API key (env {API_KEY_ENV})",
    )
    add_client_tls_arguments(sub.choices["generate"], "--server")

    serve = sub.add_parser("serve", help="run the gateway + router and the three lanes")
    add_serve_arguments(serve)
    serve.set_defaults(handler=cmd_serve)

    lane = sub.add_parser("lane", help="run one lane server (split topology)")
    add_lane_arguments(lane)
    lane.set_defaults(handler=cmd_lane)


def _wait_for_signal(poll=None) -> None:
    """Blocks until SIGTERM/SIGINT (or poll() returns True)."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        logging.getLogger("verifypd").info("received %s", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stop.wait(0.5):
        if poll is not None and poll():
            return


def cmd_serve(args) -> int:
    """The gateway process: resolves the arguments into CoreOptions, spawns the engine core with
    them (core/process.py), loads the tokenizer meanwhile, then serves gRPC and HTTP on one event
    loop until SIGTERM/SIGINT."""
    from verifypd.core.process import CoreProcess
    from verifypd.core.tracing import gateway_spans
    from verifypd.gateway.http_server import bind_http
    from verifypd.gateway.server import Gateway, load_codec
    from verifypd.net.limits import ConnectionLimits
    from verifypd.net.tls import server_tls
    from verifypd.net.trace_context import sample_ratio_env

    if args.log_format:  # the engine core and the lanes it starts read it from the environment
        os.environ[LOG_FORMAT_ENV] = args.log_format
    if args.trace_sample_ratio is not None:  # read by every tracer: this process's, the core's, the lanes'
        os.environ.update(sample_ratio_env(args.trace_sample_ratio))
    setup_logging()
    options = engine_options(args)  # bad flags fail here, before anything starts
    if args.http_port < 0 or args.http_max_body_bytes < 1:
        print("verifypd: error: --http-port must be >= 0 and --http-max-body-bytes >= 1", file=sys.stderr)
        return 2
    addrs = {lane: getattr(args, f"{lane}_addr") for lane in ("prefill", "draft", "verify")}
    if args.mps == "on" and (args.topology != "split" or any(addrs.values()) or not options.device.startswith("cuda")):
        print(
            "verifypd: error: --mps on is for the lanes `serve --topology split` starts on CUDA "
            "(lanes started by hand: scripts/mps.sh)",
            file=sys.stderr,
        )
        return 2
    if any(addrs.values()):
        missing = [lane for lane, a in addrs.items() if not a]
        if missing:
            print(f"verifypd: error: give all three lane addresses; missing --{missing[0]}-addr", file=sys.stderr)
            return 2
        if options.simulated_acceptance is not None:  # the verify lane decides acceptance, and it runs elsewhere
            print(
                "verifypd: error: with --verify-addr, give --simulated-acceptance to `verifypd lane verify`",
                file=sys.stderr,
            )
            return 2
    placement = lane_devices_error(options.lane_devices, args.topology, options.tensor_parallel, options.draft)
    if placement is None and options.lane_devices and any(addrs.values()):
        placement = "--lane-devices places the lanes serve starts; with --*-addr give each `verifypd lane` its --device"
    if placement is not None:
        print(f"verifypd: error: {placement}", file=sys.stderr)
        return 2
    if options.tensor_parallel > 1 and any(addrs.values()):  # the lanes were started with their own flags
        print(
            f"verifypd: error: with --*-addr, give --tensor-parallel {options.tensor_parallel} to `verifypd lane "
            "verify` and `verifypd lane prefill`, not to serve",
            file=sys.stderr,
        )
        return 2
    try:
        args.api_key = _api_key(args)
        admin_key = _admin_key(args)
        tls = server_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
        lane_tls = serve_lane_tls(args)  # checked here; the engine core loads the files itself
        resolved = core_options(args, options)  # reads the lane secret of --*-addr lanes
    except (OSError, ValueError) as exc:  # TlsError is a ValueError
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    if lane_tls is not None and args.topology != "split" and not any(addrs.values()):
        print(
            "verifypd: error: --lane-tls-* secure the lanes of --topology split or --*-addr; "
            "colocated lanes run in this process",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.health_port <= 65535:
        print(
            f"verifypd: error: --health-port must be 0 (off) or a port number; got {args.health_port}", file=sys.stderr
        )
        return 2
    if args.idle_timeout <= 0 or (args.max_connections is not None and args.max_connections < 1):
        print("verifypd: error: --idle-timeout must be > 0 and --max-connections >= 1", file=sys.stderr)
        return 2
    limits = ConnectionLimits.for_this_process(args.max_connections, args.idle_timeout)
    # Every port this process serves, bound (or checked) before the engine core loads any model:
    # a taken port fails in a second, naming its flag, not after minutes of loading.
    try:
        _check_grpc_port(args.host, args.port)
        http_sock = bind_http(args.host, args.http_port) if args.http_port else None
        health_state: dict = {}
        health_port = _start_health_port(health_state, args) if args.health_port else None
    except OSError as exc:
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    core = CoreProcess(resolved)
    try:
        gateway = Gateway(
            core.sock,
            load_codec(options.target),
            host=args.host,
            port=args.port,
            default_max_tokens=args.default_max_tokens,
            api_key=args.api_key,
            admin_key=admin_key,
            core_process=core,
            tls=tls,
            limits=limits,
            # the core says whether it caches prefixes (split: with KV by handle only, core.assembly)
            share_prefix=None if options.prefix_cache else False,
        )
    except OSError as exc:  # the gRPC port was taken between the check and the bind
        core.proc.kill()
        print(f"verifypd: error: --port {args.port}: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        core.proc.kill()
        raise
    try:
        gateway.start()
        gateway.client.spans = gateway_spans("verifypd-gateway")  # None unless OTLP is configured
        gateway.client.access_log = args.access_log
        info = gateway.info
        if info is None:  # start() waits for the core's ready message, which carries it
            raise RuntimeError("the engine core was ready without its server info")
    except Exception as exc:  # the core exited before it was ready (it printed why)
        print(f"verifypd: error: the engine core did not start: {exc}", file=sys.stderr)
        gateway.stop()
        # 2: the core refused its arguments (a flag that does not fit the model, e.g. --tensor-parallel)
        return 2 if core.wait(5) == 2 else 1
    tls_label = f", {tls.label}" if tls is not None else ""
    print(
        f"verifypd: serving {info.topology} on {gateway.address}{tls_label} "
        f"(target {options.target}, draft {options.draft}, schedule {options.config.schedule}"
        f"{simulated_label(options)}; engine core pid {core.pid})",
        file=sys.stderr,
        flush=True,
    )
    try:
        if http_sock is not None:
            gateway.http = _start_http(gateway, args, tls, http_sock, limits)
        health_state["gateway"] = gateway
        freeze_startup_heap()  # domain/heap.py: full collections stop walking the start-up heap
        if health_port is not None:
            print(
                f"verifypd: health on http://{args.host}:{health_port.port}/health (plaintext, for probes)",
                file=sys.stderr,
                flush=True,
            )
        _wait_for_signal(poll=gateway.core_exited.is_set)
        if gateway.core_exited.is_set():
            print(f"verifypd: error: {gateway.client.failed}; exiting", file=sys.stderr)
            return 1
        gateway.drain(args.drain_timeout)
    finally:
        gateway.stop()
    return 0


def _api_key(args) -> str | None:
    """--api-key-file, else env VERIFYPD_API_KEY, else --api-key (warned about: argv is public)."""
    from verifypd.net.auth import load_secret

    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key-file or --api-key, not both")
    if args.api_key:
        logging.getLogger("verifypd").warning(
            "--api-key on the command line is visible to every user of this machine (ps, /proc/PID/cmdline); "
            "use --api-key-file or env %s",
            API_KEY_ENV,
        )
        return args.api_key
    return load_secret(args.api_key_file, env=API_KEY_ENV, what="API key")


def _admin_key(args) -> str | None:
    """--admin-key-file / VERIFYPD_ADMIN_KEY (checked: long enough, not the API key); None: Control
    stays read-only (UpdateConfig refused), which the start-up log says."""
    from verifypd.net.auth import check_gateway_keys, load_secret

    key = load_secret(args.admin_key_file, env=ADMIN_KEY_ENV, what="admin key")
    check_gateway_keys(args.api_key, key)
    if key is None:
        logging.getLogger("verifypd").warning(
            "no admin key (--admin-key-file or env %s): Control.UpdateConfig is refused, the runtime config "
            "stays as started",
            ADMIN_KEY_ENV,
        )
    return key


def _check_grpc_port(host: str, port: int) -> None:
    """OSError naming --port when host:port cannot be bound (the gateway binds it for real later)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), port))
            probe.listen(1)
        except OSError as exc:
            raise OSError(f"--port {port}: cannot bind the gRPC port {host}:{port}: {exc.strerror or exc}") from None


def _start_http(gateway, args, tls, sock, limits):
    from verifypd.gateway.http_api import HttpApi
    from verifypd.gateway.http_server import HttpServer

    api = HttpApi(
        gateway,
        model_name=args.served_model_name,
        max_body_bytes=args.http_max_body_bytes,
        api_key=args.api_key,
        tool_parser=args.tool_parser,
    )
    http = HttpServer(api.app, args.host, args.http_port, loop=gateway.loop, tls=tls, sock=sock, limits=limits).start()
    print(
        f"verifypd: OpenAI-compatible HTTP API on {http.url}/v1 (model {api.model_name!r})", file=sys.stderr, flush=True
    )
    return http


def _start_health_port(state: dict, args):
    """Plaintext `GET /health` for probes: 200 while the gateway serves (as the HTTP API's /health);
    503 "starting" until `state["gateway"]` is set (bound before the models load)."""
    from verifypd.net.health import HealthPort

    def check():
        gateway = state.get("gateway")
        if gateway is None:
            return False, "starting"
        if gateway.client.failed:
            return False, gateway.client.failed
        if gateway.health.serving:
            return True, "serving"
        return False, gateway.client.stalled or "not serving (starting, draining or stopped)"

    try:
        return HealthPort(args.host, args.health_port, {"/health": check})
    except OSError as exc:
        raise OSError(f"--health-port {args.health_port}: {exc}") from None


def cmd_lane(args) -> int:
    from verifypd.lanes.rpc.lane_ports import build_lane_server
    from verifypd.lanes.rpc.lane_server import LaneServicer
    from verifypd.lanes.rpc.lane_spans import LaneServerSpans
    from verifypd.net.auth import load_secret
    from verifypd.net.lane_tls import lane_tls

    setup_logging()
    try:
        secret = load_secret(args.secret_file)
        tls = lane_tls(args.tls_cert_file, args.tls_key_file, args.tls_ca_file, args.tls_server_name)
    except (OSError, ValueError) as exc:  # TlsError is a ValueError
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.health_port <= 65535:
        print(
            f"verifypd: error: --health-port must be 0 (off) or a port number; got {args.health_port}", file=sys.stderr
        )
        return 2
    if secret is None and not args.allow_unauthenticated:
        print(
            f"verifypd: error: a lane needs a shared secret (--secret-file or env {LANE_SECRET_ENV}); only the "
            f"gateway may call lanes. --allow-unauthenticated serves without one (tests only).",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.device_lanes <= 3:
        print(f"verifypd: error: --device-lanes must be 1, 2 or 3; got {args.device_lanes}", file=sys.stderr)
        return 2
    try:
        options = engine_options(args)
    except ValueError as exc:  # InvalidRequest: e.g. --k-max out of range
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    if options.tensor_parallel > 1 and args.lane == "draft":
        print(
            f"verifypd: error: --tensor-parallel {options.tensor_parallel}: the draft lane is not sharded (only "
            "the verify and prefill lanes run the target)",
            file=sys.stderr,
        )
        return 2
    if args.lane == "verify":
        warn_simulated(options)
    elif options.simulated_acceptance is not None:
        print("verifypd: error: --simulated-acceptance applies to the verify lane only", file=sys.stderr)
        return 2
    servicer = LaneServicer(args.lane, options, secret=secret, tls=tls)
    servicer.spans = LaneServerSpans.from_env(args.lane)  # None unless OTLP is configured (inherited)
    if not -1 <= args.call_port <= 65535:
        print(f"verifypd: error: --call-port must be -1, 0 or a port number; got {args.call_port}", file=sys.stderr)
        return 2
    try:
        server, port, health = build_lane_server(
            servicer, args.host, args.port, None if args.call_port == -1 else args.call_port
        )
        health_port = None
        if args.health_port:
            from verifypd.net.health import HealthPort, serving_check

            health_port = HealthPort(args.host, args.health_port, {"/health": serving_check(health)})
    except OSError as exc:
        print(f"verifypd: error: cannot serve the {args.lane} lane: {exc}", file=sys.stderr)
        servicer.close()
        return 2
    if args.port_file:  # written atomically: the launcher reads it as soon as it exists
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:  # port, then the pool files this lane owns (for cleanup)
            shards = [d.shm_path for d in servicer.rank_shards if d.shm_path]  # --tensor-parallel: the other ranks'
            f.write("\n".join([str(port), *[p.shm_path for p in servicer.owned.values() if p.shm_path], *shards]))
        os.replace(tmp, args.port_file)
    freeze_startup_heap()  # domain/heap.py (the lane's pools come later, in its setup call: few objects)
    calls = f", call channel on port {servicer.call_server.port}" if servicer.call_server else ""
    calls += ", mutual TLS" if tls is not None else ""
    calls += f", plaintext health on port {health_port.port}" if health_port is not None else ""
    print(
        f"verifypd: {args.lane} lane serving on {args.host}:{port}{calls} "
        f"(pid {os.getpid()}{simulated_label(options)})",
        file=sys.stderr,
        flush=True,
    )
    parent = args.parent_pid
    try:
        _wait_for_signal(poll=(lambda: os.getppid() != parent) if parent else None)
    finally:
        health.set(False)
        server.stop(1).wait(2)
        servicer.close()
    return 0


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
