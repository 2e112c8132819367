"""`verifypd-operator`: kopf (handlers, peering, liveness endpoint) plus the OTLP receiver."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import zlib

import kopf

from .control_client import ControlClient
from .handlers import OperatorContext, register
from .kube import CERT_MANAGER_KINDS, ApiError, Kube, api_client_from_env
from .otlp_receiver import MetricsStore, serve
from .tls_issuer import resolve as resolve_tls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser("verifypd-operator")
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only these namespaces (repeatable); default: cluster-wide",
    )
    p.add_argument("--otlp-port", type=int, default=int(env("VERIFYPD_OTLP_PORT", "4317")))
    p.add_argument(
        "--otlp-endpoint",
        default=env("VERIFYPD_OTLP_ENDPOINT", "http://verifypd-operator-otlp:4317"),
        help="OTEL_EXPORTER_OTLP_ENDPOINT given to the pods the operator runs",
    )
    p.add_argument(
        "--peering-name",
        default=env("VERIFYPD_PEERING_NAME", ""),
        help="run kopf peering through this (Cluster)KopfPeering, which must exist (the chart "
        "creates it with operator.replicas > 1); default: no peering (one replica)",
    )
    p.add_argument("--standalone", action="store_true", help="no peering, even with --peering-name")
    p.add_argument(
        "--priority", type=int, default=None, help="peering priority; default derived from POD_NAME so replicas differ"
    )
    p.add_argument("--liveness", default=env("VERIFYPD_LIVENESS", "http://0.0.0.0:8080/healthz"))
    p.add_argument(
        "--tick",
        type=float,
        default=float(env("VERIFYPD_TICK_SECONDS", "5")),
        help="timer period; each config is evaluated every spec.autoscaling.intervalSeconds",
    )
    p.add_argument("--log-level", default=env("VERIFYPD_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--tls",
        choices=["off", "operator", "cert-manager", "auto"],
        default=env("VERIFYPD_TLS", "off"),
        help="TLS for every config's pods (docs/kubernetes.md 'TLS'): off; operator (a CA and a certificate "
        "per config in Secrets it owns and renews); cert-manager (Certificate objects); auto "
        "(cert-manager when its API is served, else operator)",
    )
    p.add_argument(
        "--tls-cert-days",
        type=int,
        default=int(env("VERIFYPD_TLS_CERT_DAYS", "30")),
        help="validity of a config's certificate; renewed when a third is left",
    )
    p.add_argument(
        "--tls-issuer",
        default=env("VERIFYPD_TLS_ISSUER", "") or None,
        help="cert-manager: Issuer/NAME or ClusterIssuer/NAME to sign the certificates (default: a "
        "self-signed CA per config)",
    )
    return p.parse_args(argv)


def peering_priority(pod_name: str) -> int:
    """Distinct per replica: kopf freezes *all* peers that share the top priority."""
    return 100 + zlib.crc32(pod_name.encode()) % 10_000


def peering_paths(name: str, namespaces: list[str]) -> list[str]:
    """API paths of the peering objects kopf will use: one ClusterKopfPeering cluster-wide, else a
    KopfPeering per watched namespace."""
    if not namespaces:
        return [f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"]
    return [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{name}" for ns in namespaces]


def peering_problems(kube: Kube, name: str, namespaces: list[str]) -> list[str]:
    """kopf waits silently (forever) for a peering object it cannot see: check first."""
    out = []
    for path in peering_paths(name, namespaces):
        try:
            if kube.request("GET", path) is None:
                out.append(f"{path}: not found")
        except ApiError as e:
            out.append(f"{path}: {e}")
    return out


def register_login(registry: kopf.OperatorRegistry) -> None:
    """A plain OperatorRegistry has no login handlers, so kopf would never authenticate. Log in the
    way the Kube client does (the official client's config): in-cluster with the pod's service
    account, else $KUBECONFIG / ~/.kube/config (exec plugins and client certs included)."""

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_via_client(**kwargs)


def apply_settings(settings: kopf.OperatorSettings, *, priority: int, standalone: bool) -> None:
    """The operator's kopf settings (the entry point's; tests that run the handlers in-process too)."""
    settings.peering.priority = priority
    settings.peering.mandatory = not standalone
    settings.posting.level = logging.WARNING  # our own events are explicit
    settings.watching.server_timeout = 300
    # Progress in annotations only: status stays ours (and schema-pruned).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="verifypd.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="verifypd.dev")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = MetricsStore()
    server, port = serve(store, f"[::]:{args.otlp_port}")
    log = logging.getLogger(__name__)
    log.info("OTLP receiver on :%d", port)
    kube = Kube(api_client_from_env())
    try:
        tls = resolve_tls(kube, args.tls, args.tls_cert_days, args.tls_issuer)
    except ValueError as exc:
        log.error("%s", exc)
        server.stop(grace=0)
        sys.exit(2)
    if tls is not None and tls.mode == "cert-manager":
        kube.kinds += tuple(CERT_MANAGER_KINDS)
    ctx = OperatorContext(kube=kube, store=store, control=ControlClient(), otlp_endpoint=args.otlp_endpoint, tls=tls)
    standalone = args.standalone or not args.peering_name
    if not standalone:
        problems = peering_problems(kube, args.peering_name, args.namespace)
        if problems:
            log.error(
                "peering %r requested but unusable: %s. Create it and grant get/patch on it and "
                "list/watch on its kind (the chart does both with operator.replicas > 1), or run "
                "one replica with --standalone",
                args.peering_name,
                "; ".join(problems),
            )
            server.stop(grace=0)
            sys.exit(2)
        log.info("peering through %s (priority decides the active replica)", args.peering_name)
    else:
        log.info("standalone: no peering (run a single replica)")
    registry = kopf.OperatorRegistry()
    register_login(registry)
    register(registry, ctx, tick_s=args.tick)
    priority = (
        args.priority
        if args.priority is not None
        else peering_priority(os.environ.get("POD_NAME", os.uname().nodename))
    )

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        apply_settings(settings, priority=priority, standalone=standalone)

    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                standalone=standalone,
                peering_name=None if standalone else args.peering_name,
                liveness_endpoint=args.liveness,
            )
        )
    finally:
        server.stop(grace=2)


if __name__ == "__main__":
    main()
