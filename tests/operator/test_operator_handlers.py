"""The real kopf operator (our handlers) against kmock's Kubernetes emulator over HTTP, with a
real in-test gRPC Control server standing in for the router.

One scenario, in order: create -> owned Deployments/Services with owner refs, status, events;
spec change (colocated -> split) -> patched/pruned; metrics breach the ITL SLO -> the timer lowers
kMax through UpdateConfig (the spec's k is fixed: with the router's adaptive k the policy leaves k
alone), then scales the verify Deployment; delete -> nothing left behind.
Waits poll for a state with a generous deadline; nothing asserts on timing. On a loaded 2-core
machine kmock (in Python, on the test's event loop) serves only a few requests per second, so one
reconcile can take seconds: deadlines are minutes, and a wait returns as soon as its state holds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent import futures

import grpc
import kmock
import kopf
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from operator_helpers import declare_kinds, emulator

from verifypd.domain import metric_names as mn
from verifypd.v1 import control_pb2, control_pb2_grpc
from verifypd_operator.config_secrets import read_admin_secret
from verifypd_operator.control_client import ControlClient
from verifypd_operator.handlers import OperatorContext, register
from verifypd_operator.kube import Kube, api_client_for
from verifypd_operator.otlp_receiver import MetricsStore

CR_PATH = "/apis/verifypd.dev/v1alpha1/namespaces/default/verifypdconfigs"


class FakeRouter(control_pb2_grpc.ControlServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.config = control_pb2.RuntimeConfig(
            k_min=0, k_max=4, k_initial=2, adaptive=True, prefill_token_budget=256, revision=1
        )
        self.updates: list[control_pb2.UpdateConfigRequest] = []
        self.credentials: list[str] = []  # `authorization` of every UpdateConfig

    def GetConfig(self, request, context):
        with self.lock:
            return control_pb2.RuntimeConfig(**{f.name: v for f, v in self.config.ListFields()})

    def UpdateConfig(self, request, context):
        with self.lock:
            self.credentials.append(dict(context.invocation_metadata()).get("authorization", ""))
            self.updates.append(request)
            self.config.MergeFrom(request.config)
            self.config.revision += 1
            return self.config


def itl_breach(now: float, start: float, n: int = 50) -> metrics_service_pb2.ExportMetricsServiceRequest:
    """A cumulative export: `n` requests since `start`, TTFT fine (~0.1 s), ITL ~0.3 s (SLO 0.05 s)."""

    def kv(k, v):
        return common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v))

    def hist(name, counts):
        return metrics_pb2.Metric(
            name=name,
            histogram=metrics_pb2.Histogram(
                aggregation_temporality=metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE,
                data_points=[
                    metrics_pb2.HistogramDataPoint(
                        start_time_unix_nano=int(start * 1e9),
                        time_unix_nano=int(now * 1e9),
                        explicit_bounds=[0.05, 0.2, 0.5],
                        bucket_counts=counts,
                        count=sum(counts),
                    )
                ],
            ),
        )

    rm = metrics_pb2.ResourceMetrics(
        resource={
            "attributes": [
                kv(mn.RES_CONFIG_NAME, "demo"),
                kv(mn.RES_CONFIG_NAMESPACE, "default"),
                kv(mn.RES_POD_NAME, "demo-gateway-7d9f-abcde"),
            ]
        },
        scope_metrics=[
            metrics_pb2.ScopeMetrics(
                metrics=[hist(mn.TIME_TO_FIRST_TOKEN, [0, n, 0, 0]), hist(mn.TIME_PER_OUTPUT_TOKEN, [0, 0, n, 0])]
            )
        ],
    )
    return metrics_service_pb2.ExportMetricsServiceRequest(resource_metrics=[rm])


async def wait_for(fn, what, timeout=120.0, why=None):
    """Polls `fn` until it returns something true; on timeout `why()` (if given) says what was seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(fn)
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; seen: {await asyncio.to_thread(why)}" if why is not None else ""
            logging.getLogger(__name__).error("timed out waiting for %s%s", what, seen)
            raise AssertionError(f"timed out waiting for {what}{seen}")
        await asyncio.sleep(0.1)


@pytest.mark.timeout(480)
@pytest.mark.serial  # its decisions follow measured latency: run alone (scripts/test.sh)
def test_operator_end_to_end_against_kmock(caplog):
    caplog.set_level(logging.INFO)
    router = FakeRouter()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServicer_to_server(router, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        asyncio.run(asyncio.wait_for(_scenario(router, port), timeout=420))
    finally:
        grpc_server.stop(None)


async def _scenario(router: FakeRouter, control_port: int) -> None:
    async with emulator() as k, kmock.Server(k):
        declare_kinds(k)
        url = str(k.url).rstrip("/")
        kube = Kube(api_client_for(url))
        store = MetricsStore()
        ctx = OperatorContext(
            kube=kube,
            store=store,
            control=ControlClient(timeout_s=10),
            otlp_endpoint="http://verifypd-operator-otlp:4317",
            control_target=lambda name, ns: f"127.0.0.1:{control_port}",
        )
        registry = kopf.OperatorRegistry()
        # Not faster: every tick patches status, and kmock's emulator, under concurrent patches on a
        # loaded machine, can drop kopf's diff-base annotation (the reconcile then re-runs for an
        # older diff). A reconcile keeps the live Deployment replicas (the timer's scale) unless the
        # diff edits that unit's `replicas`, which an older diff can; the real API server does not
        # drop annotations (see test_operator_envtest_operator.py); fewer ticks make it rare here.
        register(registry, ctx, tick_s=1.0)

        @kopf.on.login(registry=registry)
        def login(**_):
            return kopf.ConnectionInfo(server=url, insecure=True, default_namespace="default")

        @kopf.on.startup(registry=registry)
        def configure(settings: kopf.OperatorSettings, **_):
            settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="verifypd.dev")
            settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="verifypd.dev")
            settings.posting.level = logging.WARNING
            settings.watching.reconnect_backoff = 0.1
            settings.scanning.disabled = True  # the namespace is given; no Namespace objects in the mock

        cr = {
            "apiVersion": "verifypd.dev/v1alpha1",
            "kind": "VerifyPDConfig",
            "metadata": {
                "name": "demo",
                "namespace": "default",
                "uid": "uid-demo-1",
                "generation": 1,
                "resourceVersion": "1",
            },
            "spec": {
                "topology": "colocated",
                "slo": {"ttftP95Ms": 500, "itlP95Ms": 50},
                "speculation": {"kMin": 1, "kInitial": 2, "kMax": 2, "adaptive": False},
                "lanes": {"verify": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}},
                # Evaluate rarely until metrics exist; the scenario then lowers it.
                "autoscaling": {
                    "intervalSeconds": 3600,
                    "breachPeriods": 1,
                    "minSamples": 10,
                    "scaleUpCooldownSeconds": 0,
                    "configCooldownSeconds": 0,
                },
            },
        }
        await asyncio.to_thread(kube.request, "POST", CR_PATH, cr)

        stop = asyncio.Event()
        op = asyncio.create_task(
            kopf.operator(registry=registry, standalone=True, namespaces=["default"], stop_flag=stop)
        )
        try:
            await _create_and_update(kube, router)
            await _autoscale(kube, store, router)
            await _delete(kube)
        finally:
            stop.set()
            await asyncio.wait_for(op, timeout=20)


# NB: the mock API server runs on this event loop: every blocking client call goes through a
# thread (asyncio.to_thread / wait_for), never directly from a coroutine.
def _cr(kube):
    return kube.request("GET", f"{CR_PATH}/demo") or {}


async def _create_and_update(kube: Kube, router: FakeRouter) -> None:
    dep = await wait_for(lambda: kube.get("Deployment", "default", "demo-colocated"), "colocated Deployment")
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-1"
    assert dep["metadata"]["ownerReferences"][0]["controller"] is True
    svc = await wait_for(lambda: kube.get("Service", "default", "demo"), "gateway Service")
    assert svc["metadata"]["ownerReferences"][0]["name"] == "demo"

    status = await wait_for(
        lambda: (_cr(kube).get("status") or {}).get("conditions") and _cr(kube)["status"], "status conditions"
    )
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types["Progressing"] == "True" and types["Ready"] == "False"  # no pod is ready in a mock
    assert status["applied"]["kMax"] == 2 and status["replicasText"] == "1 pods"
    # The timer syncs the router to the spec's knobs (router started with kMax 4, budget 256).
    await wait_for(
        lambda: router.config.k_max == 2 and router.config.prefill_token_budget == 512,
        "runtime config pushed to the router",
    )
    # ... presenting the admin key of the Secret it created and mounted into the gateway.
    admin = await asyncio.to_thread(kube.get, "Secret", "default", "demo-admin-key")
    assert admin["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-1"
    assert router.credentials and set(router.credentials) == {f"Bearer {read_admin_secret(admin)}"}
    events = await wait_for(
        lambda: [
            e
            for e in (kube.request("GET", "/api/v1/namespaces/default/events") or {}).get("items", [])
            if e.get("reason") == "Reconciled"
        ],
        "Reconciled event",
    )
    assert events[0]["involvedObject"]["name"] == "demo"

    # Spec change: split topology. Lane Deployments appear, the colocated one is pruned.
    await asyncio.to_thread(
        kube.request,
        "PATCH",
        f"{CR_PATH}/demo",
        {"metadata": {"generation": 2}, "spec": {"topology": "split"}},
        None,
        "application/merge-patch+json",
    )
    await wait_for(lambda: kube.get("Deployment", "default", "demo-verify"), "verify Deployment")
    await wait_for(lambda: kube.get("Deployment", "default", "demo-colocated") is None, "colocated pruned")
    gw = await asyncio.to_thread(kube.get, "Deployment", "default", "demo-gateway")
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--topology") + 1] == "split"
    await wait_for(lambda: (_cr(kube).get("status") or {}).get("observedGeneration") == 2, "observedGeneration 2")


async def _autoscale(kube: Kube, store: MetricsStore, router: FakeRouter) -> None:
    n_updates = len(router.updates)
    start = time.time() - 30
    assert store.ingest(itl_breach(time.time(), start)) == (2, 0)
    # A gateway exports every few seconds. One export goes stale after staleAfterSeconds (20 s),
    # and on a loaded machine the two decisions below can take longer than that to come.
    exporter = asyncio.create_task(_export_breach(store, start))
    try:
        await _lower_k_then_scale(kube, router, n_updates)
    finally:
        exporter.cancel()


async def _export_breach(store: MetricsStore, start: float) -> None:
    n = 50
    while True:
        await asyncio.sleep(2.0)
        n += 10
        store.ingest(itl_breach(time.time(), start, n))


async def _lower_k_then_scale(kube: Kube, router: FakeRouter, n_updates: int) -> None:
    await asyncio.to_thread(
        kube.request,
        "PATCH",
        f"{CR_PATH}/demo",
        {"spec": {"autoscaling": {"intervalSeconds": 1}}},
        None,
        "application/merge-patch+json",
    )
    # First decision: ITL breached -> lower kMax (2 -> 1) through UpdateConfig, before scaling.
    upd = await wait_for(lambda: [u for u in router.updates[n_updates:] if u.config.k_max == 1], "kMax lowered")
    assert upd[0].requested_by == "operator/default/demo" and "ITL" in upd[0].reason
    assert (await asyncio.to_thread(kube.get, "Deployment", "default", "demo-verify"))["spec"]["replicas"] == 1
    # Next: kMax at its floor, still breached -> add a verify replica (a scale patch).
    await wait_for(
        lambda: kube.get("Deployment", "default", "demo-verify")["spec"]["replicas"] == 2,
        "verify scaled to 2",
        timeout=180,
        why=lambda: {
            k: v for k, v in (_cr(kube).get("status") or {}).items() if k in ("lastDecision", "autoscaler", "observed")
        },
    )
    st = await wait_for(
        lambda: (
            (_cr(kube).get("status") or {}).get("lastDecision", {}).get("action") == "scale-up" and _cr(kube)["status"]
        ),
        "scale decision in status",
    )
    assert st["lastDecision"]["scales"] == [{"unit": "verify", "from": 1, "to": 2}]
    assert st["applied"]["kMax"] == 1 and st["replicas"]["verify"] == 2
    assert st["observed"]["itlP95Ms"] > 50
    events = await asyncio.to_thread(kube.request, "GET", "/api/v1/namespaces/default/events")
    reasons = {e.get("reason") for e in events["items"]}
    assert {"Autoscale:lower-k", "Autoscale:scale-up"} <= reasons


async def _delete(kube: Kube) -> None:
    await asyncio.to_thread(kube.request, "DELETE", f"{CR_PATH}/demo")
    await wait_for(lambda: kube.request("GET", f"{CR_PATH}/demo") is None, "CR gone (finalizer released)")
    assert await asyncio.to_thread(kube.owned, "demo", "default") == []
