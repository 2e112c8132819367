"""Pure helpers between the CR's `.status` and the decision function's inputs/outputs."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from .decision import Current, Decision, Knobs, Observed, clamp_knobs
from .spec import COLOCATED, LANES, Spec


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> float | None:
    if not s:
        return None
    return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def set_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    now: float,
    generation: int | None,
) -> list[dict[str, Any]]:
    """metav1.Condition semantics: lastTransitionTime moves only when the status flips."""
    out = [dict(c) for c in conditions or [] if c.get("type") != type_]
    old = next((c for c in conditions or [] if c.get("type") == type_), None)
    status = "True" if ok else "False"
    ltt = old["lastTransitionTime"] if old and old.get("status") == status else rfc3339(now)
    cond = {"type": type_, "status": status, "reason": reason, "message": message[:1000], "lastTransitionTime": ltt}
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    order = {"Ready": 0, "Progressing": 1, "Degraded": 2}
    return sorted(out, key=lambda c: order.get(c["type"], 9))


# Degraded reasons the reconcile handler owns: the timer leaves them alone (it would otherwise
# flip Degraded back to False on its next tick while the objects still cannot be applied).
RECONCILE_FAILED = "ReconcileFailed"
API_NOT_SERVED = "APINotServed"
RECONCILE_REASONS = (RECONCILE_FAILED, API_NOT_SERVED)


def reconcile_failed(
    conditions: Sequence[Mapping[str, Any]] | None, reason: str, message: str, now: float, generation: int | None
) -> list[dict[str, Any]]:
    """Conditions after a failed reconcile: Degraded=True with the cause, Progressing=False."""
    conds = set_condition(conditions, "Degraded", True, reason, message, now, generation)
    return set_condition(conds, "Progressing", False, RECONCILE_FAILED, message, now, generation)


def reconcile_failure_pending(conditions: Sequence[Mapping[str, Any]] | None) -> bool:
    return any(
        c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in RECONCILE_REASONS
        for c in conditions or []
    )


def knobs_to_status(k: Knobs) -> dict[str, Any]:
    return {
        "kMin": k.k_min,
        "kMax": k.k_max,
        "kInitial": k.k_initial,
        "adaptive": k.adaptive,
        "priorities": {"draft": k.prio_draft, "verify": k.prio_verify, "prefill": k.prio_prefill},
        "prefillTokenBudget": k.prefill_token_budget,
    }


def knobs_from_status(d: Mapping[str, Any] | None) -> Knobs | None:
    if not d or "kMax" not in d:
        return None
    p = d.get("priorities") or {}
    return Knobs(
        int(d["kMin"]),
        int(d["kMax"]),
        int(d["kInitial"]),
        bool(d.get("adaptive", True)),
        int(p.get("draft", 2)),
        int(p.get("verify", 1)),
        int(p.get("prefill", 0)),
        int(d.get("prefillTokenBudget", 512)),
    )


def unit_replicas(
    spec: Spec, status: Mapping[str, Any] | None, reset: Sequence[str] = (), live: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The replicas the operator maintains, clamped into [min, max]: the spec's when the user changed
    that unit's `replicas` field (`reset`), else the unit's Deployment's own (`live`: the autoscaler
    scales the Deployment before it writes status, so a reconcile that started from an older status
    must not undo that scale), else the last value in status, else the spec's (first time)."""
    have = ((status or {}).get("autoscaler") or {}).get("replicas") or {}
    live = live or {}
    out = {}
    for u in spec.units():
        b = spec.bounds(u)
        r = b.replicas if u in reset else int(live[u]) if u in live else int(have[u]) if u in have else b.replicas
        out[u] = min(max(r, b.min), b.max)
    return out


def replicas_text(spec: Spec, replicas: Mapping[str, int]) -> str:
    if spec.topology == COLOCATED:
        return f"{replicas.get(COLOCATED, 0)} pods"
    return "/".join(f"{lane[0]}{replicas.get(lane, 0)}" for lane in LANES)


def lane_replicas(spec: Spec, replicas: Mapping[str, int]) -> dict[str, int]:
    return {lane: replicas.get(COLOCATED if spec.topology == COLOCATED else lane, 0) for lane in LANES}


def current_from_status(spec: Spec, status: Mapping[str, Any] | None, now: float) -> Current:
    st = status or {}
    a = st.get("autoscaler") or {}
    return Current(
        now=now,
        replicas=unit_replicas(spec, st),
        knobs=clamp_knobs(knobs_from_status(st.get("applied")), spec),
        last_scale={u: t for u, s in (a.get("lastScale") or {}).items() if (t := parse_time(s)) is not None},
        last_config_change=parse_time(a.get("lastConfigChange")),
        breach_streak=int(a.get("breachStreak", 0)),
        headroom_streak=int(a.get("headroomStreak", 0)),
        prev_queue_depth={k: float(v) for k, v in (a.get("queueDepth") or {}).items()},
    )


def observed_to_status(o: Observed, window_s: int, now: float) -> dict[str, Any]:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    return {
        "ttftP95Ms": ms(o.ttft_p95_s),
        "itlP95Ms": ms(o.itl_p95_s),
        "samples": o.samples,
        "queueDepth": {lane: o.queue_depth.get(lane, 0.0) for lane in LANES},
        "acceptanceRate": None if o.acceptance_rate is None else round(o.acceptance_rate, 4),
        "windowSeconds": window_s,
        "time": rfc3339(now),
    }


def autoscaler_status(
    spec: Spec, before: Current, d: Decision, observed: Observed, replicas: Mapping[str, int], now: float
) -> dict[str, Any]:
    last_scale = {u: rfc3339(t) for u, t in before.last_scale.items()}
    for s in d.scales:
        last_scale[s.unit] = rfc3339(now)
    last_cfg = (
        rfc3339(now)
        if d.knobs is not None
        else (rfc3339(before.last_config_change) if before.last_config_change is not None else None)
    )
    return {
        "replicas": dict(replicas),
        "lastScale": last_scale,
        "lastConfigChange": last_cfg,
        "breachStreak": d.breach_streak,
        "headroomStreak": d.headroom_streak,
        "queueDepth": {lane: observed.queue_depth.get(lane, 0.0) for lane in LANES},
        "lastEvaluation": rfc3339(now),
        "lastReason": d.reason,
    }  # why, also when holding


def decision_to_status(d: Decision, now: float) -> dict[str, Any]:
    return {
        "action": d.action,
        "reason": d.reason,
        "time": rfc3339(now),
        "scales": [{"unit": s.unit, "from": s.from_replicas, "to": s.to_replicas} for s in d.scales],
    }
