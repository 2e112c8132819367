"""kopf handlers: read, call a pure function, apply. No policy and no manifest logic lives here.

Handlers are registered into a given registry by `register()` (not at import time), so the
entry point and the tests each get their own registry, tick and dependencies.

Handlers are sync: kopf runs them in its thread pool, which keeps the blocking Kubernetes and
gRPC clients off the event loop.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from . import status as st
from .builders import build_all
from .config_secrets import read_admin_secret, read_lane_secret
from .control_client import ControlClient
from .decision import Decision, clamp_knobs, decide
from .kube import ApiError, ApiNotServed, Kube
from .object_meta import admin_secret_name, deployment_name, gateway_pods_service_name, lane_secret_name
from .otlp_receiver import MetricsStore
from .spec import COLOCATED, GROUP, GRPC_PORT, PLURAL, VERSION, parse_spec
from .tls_issuer import TlsSettings, control_tls, tls_objects
from .tls_manifests import tls_secret_name, with_tls


def default_control_target(name: str, namespace: str) -> str:
    return f"{gateway_pods_service_name(name)}.{namespace}.svc:{GRPC_PORT}"


@dataclasses.dataclass
class OperatorContext:
    kube: Kube
    store: MetricsStore
    control: ControlClient
    otlp_endpoint: str
    control_target: Callable[[str, str], str] = default_control_target
    clock: Callable[[], float] = time.time
    tls: TlsSettings | None = None  # None: plaintext pods (tls_manifests.py)


def _reset_units(diff: Any) -> list[str]:
    """Units whose `replicas` the user changed: the spec value overrides the autoscaler's."""
    out = []
    for _, path, _, _ in diff or ():
        path = tuple(path)
        if path[:2] == ("spec", "lanes") and len(path) >= 4 and path[3] == "replicas":
            out.append(path[2])
        elif path[:3] == ("spec", "colocated", "replicas"):
            out.append(COLOCATED)
        elif path[:2] in (("spec", "lanes"), ("spec", "colocated"), ("spec",)) and len(path) <= 2:
            out += ["prefill", "draft", "verify", COLOCATED]  # the whole block was (re)set
    return out


def _live_replicas(kube: Kube, name: str, namespace: str, spec) -> dict[str, int]:
    """spec.replicas of the unit Deployments that exist now (the autoscaler's latest scale)."""
    out = {}
    for unit in spec.units():
        dep = kube.get("Deployment", namespace, deployment_name(name, unit))
        if dep is not None and (dep.get("spec") or {}).get("replicas") is not None:
            out[unit] = int(dep["spec"]["replicas"])
    return out


def lane_secret_token(kube: Kube, name: str, namespace: str) -> str:
    """The live lane Secret's token, or a new one when there is none yet (generated once, then kept:
    a new token on every reconcile would cut running gateways off their lanes)."""
    return read_lane_secret(kube.get("Secret", namespace, lane_secret_name(name))) or secrets.token_hex(32)


def admin_key_token(kube: Kube, name: str, namespace: str, create: bool = True) -> str | None:
    """Control's admin key from the live Secret; a new one when absent and `create` (the reconcile),
    else None (the timer: the next reconcile creates it)."""
    key = read_admin_secret(kube.get("Secret", namespace, admin_secret_name(name)))
    return key or (secrets.token_hex(32) if create else None)


def _readiness(ctx: OperatorContext, name: str, namespace: str, objs: list[Mapping[str, Any]]):
    """(ready, progressing, message) from the owned Deployments' status."""
    waiting, rolling = [], []
    for o in objs:
        if o["kind"] != "Deployment":
            continue
        live = ctx.kube.get("Deployment", namespace, o["metadata"]["name"]) or {}
        want = int((live.get("spec") or {}).get("replicas", o["spec"]["replicas"]))
        s = live.get("status") or {}
        if int(s.get("readyReplicas") or 0) < 1:
            waiting.append(o["metadata"]["name"])
        if int(s.get("updatedReplicas") or 0) < want or int(s.get("readyReplicas") or 0) < want:
            rolling.append(o["metadata"]["name"])
    msg = ("waiting for " + ", ".join(waiting)) if waiting else "all Deployments have ready replicas"
    return not waiting, bool(rolling), msg


# Why an owned object could not be applied, for the Degraded condition and the Warning event.
HINTS = {
    "ResourceClaimTemplate": "gpuSharing: dra needs resource.k8s.io/v1 (Kubernetes >= 1.34 with "
    "DynamicResourceAllocation); use gpuSharing: devicePlugin on this cluster"
}


class ReconcileError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def apply_all(ctx: OperatorContext, name: str, namespace: str, objs: list[Mapping[str, Any]]) -> list[str]:
    """Apply every object, then prune; a failure names the object, the server's message and a hint."""
    for obj in objs:
        try:
            ctx.kube.apply(obj)
        except ApiError as e:
            hint = HINTS.get(obj["kind"]) if isinstance(e, ApiNotServed) else None
            raise ReconcileError(
                e.reason, f"cannot apply {obj['kind']} {obj['metadata']['name']}: {e}" + (f" ({hint})" if hint else "")
            ) from e
    try:
        return ctx.kube.prune(name, namespace, keep=objs)
    except ApiError as e:
        raise ReconcileError(e.reason, f"cannot prune: {e}") from e


def _tls_first(
    ctx: OperatorContext, tls: TlsSettings, body, name: str, namespace: str, objs: list, now: float, logger
) -> list:
    """The reconcile's objects with TLS: the certificate objects first (pods wait for their Secret),
    then the Deployments with the Secret mounted and the TLS flags (tls_manifests.with_tls)."""
    try:
        tls_objs, why = tls_objects(ctx.kube, tls, body, namespace, now)
    except ApiError as e:
        raise ReconcileError(e.reason, f"cannot read the TLS Secrets of {name}: {e}") from e
    if why:
        logger.info("TLS for %s/%s: %s", namespace, name, why)
    return tls_objs + with_tls(objs, name)


def _renew_tls(ctx: OperatorContext, tls: TlsSettings, body, name: str, namespace: str, now: float, logger):
    """Every tick (operator mode): re-issues the certificate when less than a third of its life is
    left, applying only the Secrets (the pods reload the files; nothing restarts). Returns the
    Control client's TLS for this config (None until its Secret exists)."""
    try:
        if tls.mode == "operator":
            tls_objs, why = tls_objects(ctx.kube, tls, body, namespace, now)
            if why and ctx.kube.get("Secret", namespace, tls_secret_name(name)) is not None:  # the reconcile creates
                for obj in tls_objs:
                    ctx.kube.apply(obj)
                kopf.event(body, type="Normal", reason="CertificateRenewed", message=why)
                logger.info("TLS for %s/%s: %s", namespace, name, why)
        return control_tls(ctx.kube, name, namespace)
    except ApiError as e:
        logger.warning("TLS for %s/%s: %s", namespace, name, e)
        return None


def register(registry: kopf.OperatorRegistry, ctx: OperatorContext, tick_s: float = 5.0) -> None:
    res: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)
    # kopf runs an object's timer and its change handlers side by side (sync handlers in threads):
    # per object, a reconcile's read-replicas-then-apply and the timer's scale exclude each other.
    locks: dict[tuple[str, str], threading.Lock] = {}

    def scaling_lock(namespace: str, name: str) -> threading.Lock:
        return locks.setdefault((namespace, name), threading.Lock())

    @kopf.on.resume(**res)
    @kopf.on.create(**res)
    @kopf.on.update(**res)
    def reconcile(body, spec, name, namespace, meta, status, diff, patch, logger, **_):
        spec_ = parse_spec(spec)
        now = ctx.clock()
        gen = meta.get("generation")
        try:
            # The autoscaler's scale of a unit cannot land between reading its replicas and applying.
            with scaling_lock(namespace, name):
                try:
                    live = _live_replicas(ctx.kube, name, namespace, spec_)
                except ApiError:
                    live = {}  # the apply below reports what is wrong with the API
                replicas = st.unit_replicas(spec_, status, reset=_reset_units(diff), live=live)
                try:
                    token = lane_secret_token(ctx.kube, name, namespace)
                    admin_key = admin_key_token(ctx.kube, name, namespace)
                except ApiError as e:
                    raise ReconcileError(
                        e.reason, f"cannot read the Secrets {lane_secret_name(name)}, {admin_secret_name(name)}: {e}"
                    ) from e
                objs = build_all(
                    spec_, body, namespace, replicas, ctx.otlp_endpoint, lane_secret=token, admin_key=admin_key
                )
                if ctx.tls is not None:
                    objs = _tls_first(ctx, ctx.tls, body, name, namespace, objs, now, logger)
                pruned = apply_all(ctx, name, namespace, objs)
        except ReconcileError as e:
            # Visible where users look (status, events); kopf applies this status patch although
            # the handler fails, and retries the handler after the delay.
            patch.status["conditions"] = st.reconcile_failed(
                (status or {}).get("conditions"), e.reason, str(e), now, gen
            )
            kopf.event(body, type="Warning", reason=e.reason, message=str(e)[:1000])
            raise kopf.TemporaryError(str(e), delay=15) from e
        ctx.store.register(namespace, name)
        # The applied knobs are the timer's to change; a reconcile writes them only when there are
        # none yet or the spec's bounds moved them. Its `status` may predate the timer's last patch
        # (kopf runs the two side by side), and writing that copy back undid the timer's decision
        # on every spec event (seen: kMax lowered 2 -> 1 again and again, never reaching the scale).
        held = st.knobs_from_status((status or {}).get("applied"))
        knobs = clamp_knobs(held, spec_)
        ready, rolling, msg = _readiness(ctx, name, namespace, objs)
        conds = (status or {}).get("conditions")
        conds = st.set_condition(conds, "Ready", ready, "Available" if ready else "Unavailable", msg, now, gen)
        conds = st.set_condition(
            conds,
            "Progressing",
            True,
            "Reconciled",
            f"applied {len(objs)} objects" + (f", pruned {', '.join(pruned)}" if pruned else ""),
            now,
            gen,
        )
        if st.reconcile_failure_pending(conds) or not any(c["type"] == "Degraded" for c in conds):
            conds = st.set_condition(conds, "Degraded", False, "AsExpected", "", now, gen)
        old_units = ((status or {}).get("autoscaler") or {}).get("replicas") or {}
        patch.status["observedGeneration"] = gen
        patch.status["conditions"] = conds
        if held is None or knobs != held:
            patch.status["applied"] = st.knobs_to_status(knobs)
        patch.status["replicas"] = st.lane_replicas(spec_, replicas)
        patch.status["replicasText"] = st.replicas_text(spec_, replicas)
        # Merge-patch semantics: units that no longer exist must be nulled explicitly.
        patch.status["autoscaler"] = {"replicas": {**{u: None for u in old_units}, **replicas}}
        kopf.event(
            body, type="Normal", reason="Reconciled", message=f"{spec_.topology}: {st.replicas_text(spec_, replicas)}"
        )
        logger.info("reconciled %s/%s: %d objects, pruned %s", namespace, name, len(objs), pruned)

    @kopf.on.delete(**res)
    def delete(name, namespace, logger, **_):
        # Owner references let the garbage collector do this too; deleting explicitly makes
        # "nothing left behind" not depend on GC timing (and covers orphaning deletes).
        gone = ctx.kube.prune(name, namespace, keep=())
        ctx.store.unregister(namespace, name)
        locks.pop((namespace, name), None)
        logger.info("deleted %s/%s: %s", namespace, name, gone)

    @kopf.timer(**res, interval=tick_s, initial_delay=tick_s, idle=None)
    def autoscale(body, spec, name, namespace, meta, status, patch, logger, **_):
        ctx.store.register(namespace, name)  # idempotent; covers a fresh operator replica
        spec_ = parse_spec(spec)
        status = status or {}
        now = ctx.clock()
        before = st.current_from_status(spec_, status, now)
        last = st.parse_time((status.get("autoscaler") or {}).get("lastEvaluation"))
        decision: Decision | None = None
        replicas, knobs = dict(before.replicas), before.knobs
        if last is None or now - last >= spec_.autoscaling.interval_s:
            observed = ctx.store.observe(namespace, name, now, spec_.autoscaling.window_s)
            decision = decide(spec_, observed, before)
            with scaling_lock(namespace, name):
                for s in decision.scales:
                    ctx.kube.scale(namespace, deployment_name(name, s.unit), s.to_replicas)
                    replicas[s.unit] = s.to_replicas
            knobs = decision.knobs or knobs
            patch.status["observed"] = st.observed_to_status(observed, spec_.autoscaling.window_s, now)
            auto = st.autoscaler_status(spec_, before, decision, observed, replicas, now)
            if decision.scales:
                patch.status["replicas"] = st.lane_replicas(spec_, replicas)
                patch.status["replicasText"] = st.replicas_text(spec_, replicas)
            else:
                # The timer's body can predate a reconcile that just reset replicas from an edited
                # spec: writing its stale copy back would undo that. Replicas are written only
                # with a scale the timer itself made.
                del auto["replicas"]
            patch.status["autoscaler"] = auto
            patch.status["applied"] = st.knobs_to_status(knobs)
            if decision.changes_something:
                patch.status["lastDecision"] = st.decision_to_status(decision, now)
                kopf.event(body, type="Normal", reason=f"Autoscale:{decision.action}", message=decision.reason)
                logger.info("decision for %s/%s: %s", namespace, name, decision.reason)
            elif decision.at_limits and not status.get("lastDecision", {}).get("reason") == decision.reason:
                patch.status["lastDecision"] = st.decision_to_status(decision, now)
                kopf.event(body, type="Warning", reason="AtLimits", message=decision.reason)

        # Every tick: make every router run the applied knobs (a restarted one has CLI defaults).
        reason = decision.reason if decision is not None and decision.knobs else "sync runtime config"
        try:
            admin_key = admin_key_token(ctx.kube, name, namespace, create=False)
        except ApiError as e:
            logger.warning("cannot read Secret %s: %s", admin_secret_name(name), e)
            admin_key = None  # the routers refuse the update; status shows the Control errors
        control_tls = None
        if ctx.tls is not None:
            with scaling_lock(namespace, name):
                control_tls = _renew_tls(ctx, ctx.tls, body, name, namespace, now, logger)
        sync = ctx.control.sync(
            ctx.control_target(name, namespace),
            knobs,
            f"operator/{namespace}/{name}",
            reason,
            force=bool(decision is not None and decision.knobs),
            admin_key=admin_key,
            tls=control_tls,
        )
        applied = dict(patch.status.get("applied") or st.knobs_to_status(knobs))
        applied.update(routersInSync=sync.reached, routerErrors=len(sync.errors))
        if sync.revision is not None:
            applied["revision"] = sync.revision
        patch.status["applied"] = applied

        gen = meta.get("generation")
        objs = build_all(spec_, body, namespace, replicas, ctx.otlp_endpoint)
        ready, rolling, msg = _readiness(ctx, name, namespace, objs)
        ready = ready and sync.reached > 0
        if ready is False and not msg.startswith("waiting") and sync.reached == 0:
            msg = "no router answered Control" + (f": {sync.errors}" if sync.errors else "")
        conds = status.get("conditions")
        conds = st.set_condition(conds, "Ready", ready, "Available" if ready else "Unavailable", msg, now, gen)
        conds = st.set_condition(
            conds,
            "Progressing",
            rolling,
            "RollingOut" if rolling else "Stable",
            "replicas updating" if rolling else "all replicas updated",
            now,
            gen,
        )
        degraded_msg = "; ".join(
            ([f"Control errors: {sync.errors}"] if sync.errors else [])
            + ([decision.reason] if decision is not None and decision.at_limits else [])
        )
        if decision is None:  # not evaluated this tick: keep the SLO part of Degraded as it was
            old = next((c for c in conds if c["type"] == "Degraded"), None)
            if old and old.get("reason") == "SLOAtLimits" and not sync.errors:
                degraded_msg = old.get("message", "")
        reason_d = "ControlUnreachable" if sync.errors else ("SLOAtLimits" if degraded_msg else "AsExpected")
        if not st.reconcile_failure_pending(conds):  # the reconcile handler's failure stands until it succeeds
            conds = st.set_condition(conds, "Degraded", bool(degraded_msg), reason_d, degraded_msg, now, gen)
        if conds != status.get("conditions"):
            patch.status["conditions"] = conds
