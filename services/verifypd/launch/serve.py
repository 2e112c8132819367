"""`verifypd serve`: the gateway process. Checks the arguments, binds the public ports, spawns the
engine core (verifypd.core.process) and serves gRPC and HTTP until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import sys

from verifypd.domain.heap import freeze_startup_heap
from verifypd.domain.logs import LOG_FORMAT_ENV, setup_logging, simulated_label
from verifypd.launch.lane_devices import lane_devices_error
from verifypd.launch.serve_args import core_options, engine_options, serve_lane_tls
from verifypd.launch.signals import wait_for_signal
from verifypd.net.auth import ADMIN_KEY_ENV, API_KEY_ENV


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
        wait_for_signal(poll=gateway.core_exited.is_set)
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
