"""The autoscaling policy: a pure function `decide(spec, observed, current) -> Decision`.

Policy (docs/kubernetes.md carries the same text for users):

0. Bounds first: a unit whose replicas lie outside [min, max] (the spec changed) is clamped at
   once, cooldowns notwithstanding.
1. Hold when autoscaling is off, when the newest telemetry is older than `staleAfterSeconds` (or
   none ever arrived: no decision on stale data), or when the window holds fewer than
   `minSamples` observations -- except when the services are *idle* (fresh telemetry, no request
   finished in the window, every lane queue empty), which counts as headroom: with no load there
   is nothing to protect, so the knobs return toward the spec.
2. Hysteresis: a *breach* is a p95 above its SLO; *headroom* is every p95 below `headroomRatio`
   times its SLO; in between nothing changes. A breach must persist `breachPeriods` consecutive
   evaluations and headroom `headroomPeriods` before anything is done, and the count restarts
   after every action, so one noisy window never moves anything.
3. ITL breach only: when the draft queue is the one growing (and longer than verify's), add a
   draft replica. Otherwise, if a prefill boost (4) is in force, undo one step of it first: the
   larger prefill budget is what lengthened every step (measured, docs/kubernetes.md "Does the
   operator's k rewriting help?"). With the router's adaptive k on, k is left to the router: it
   already picks the k that maximises each request's tokens per second, i.e. minimises ITL, so a
   lower kMax could only raise ITL -- add a verify replica. With a fixed k (adaptive off), lower
   `kMax` first (by a quarter, at least 1, never below the spec's `kMin`): fewer wasted draft
   tokens shorten every verify step; only at the floor add a verify replica.
4. TTFT breach only: lower the prefill priority penalty (raise prefill priority by one, up to
   verify's) and raise the prefill token budget (x1.5, up to `prefillTokenBudgetMax`) -- only
   while ITL has headroom (below `headroomRatio` x its SLO), since a larger prefill budget spends
   ITL; otherwise, or when both are exhausted, add a prefill replica.
5. Both breached: trading one latency for the other cannot help; add capacity (verify and
   prefill replicas; one pod in the colocated topology). When the units are at max or cooling
   down: undo a prefill boost (reclaim ITL), else lower kMax with a fixed k; with adaptive k,
   hold at limits.
6. Headroom: undo in reverse order: raise kMax back by one toward the spec, then restore prefill
   priority and budget toward the spec, then remove one replica from the unit with the shortest
   queue per replica (above its min, after the scale-down cooldown).

Cooldowns: scale-up and scale-down per unit (since that unit's last scale), and one for runtime
config changes (since the last UpdateConfig this policy made).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TypedDict

from .spec import COLOCATED, Spec


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The router settings the operator pushes through `Control.UpdateConfig`."""

    k_min: int
    k_max: int
    k_initial: int
    adaptive: bool
    prio_draft: int
    prio_verify: int
    prio_prefill: int
    prefill_token_budget: int


def spec_knobs(spec: Spec) -> Knobs:
    s, p = spec.speculation, spec.priorities
    return Knobs(s.k_min, s.k_max, s.k_initial, s.adaptive, p.draft, p.verify, p.prefill, spec.prefill_token_budget)


def clamp_knobs(knobs: Knobs | None, spec: Spec) -> Knobs:
    """Keep the policy's runtime adjustments but within the (possibly changed) spec's bounds."""
    base = spec_knobs(spec)
    if knobs is None:
        return base
    k_max = min(max(knobs.k_max, base.k_min), base.k_max)
    return dataclasses.replace(
        base,
        k_max=k_max,
        k_initial=min(base.k_initial, k_max),
        prio_prefill=min(max(knobs.prio_prefill, base.prio_prefill), base.prio_verify),
        prefill_token_budget=min(
            max(knobs.prefill_token_budget, base.prefill_token_budget), spec.prefill_token_budget_max
        ),
    )


@dataclasses.dataclass(frozen=True)
class Observed:
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    samples: int = 0  # observations behind the p95s (the smaller of the two histograms' counts)
    queue_depth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    acceptance_rate: float | None = None
    age_s: float | None = 0.0  # since the newest data point of the config (None: nothing ever arrived)

    @property
    def idle(self) -> bool:
        """No request finished in the window and the services report every lane queue empty."""
        return self.samples == 0 and bool(self.queue_depth) and not any(self.queue_depth.values())


@dataclasses.dataclass(frozen=True)
class Current:
    now: float
    replicas: Mapping[str, int]  # unit -> replicas the operator last set
    knobs: Knobs
    last_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)
    last_config_change: float | None = None
    breach_streak: int = 0
    headroom_streak: int = 0
    prev_queue_depth: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scale:
    unit: str
    from_replicas: int
    to_replicas: int


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # hold | clamp | lower-k | raise-k | prefill-boost | prefill-restore | scale-up | scale-down
    reason: str
    scales: tuple[Scale, ...] = ()
    knobs: Knobs | None = None  # set only when the runtime config changes
    breach_streak: int = 0
    headroom_streak: int = 0
    at_limits: bool = False  # an SLO is breached and nothing is left to do (status: Degraded)

    @property
    def changes_something(self) -> bool:
        return bool(self.scales) or self.knobs is not None


class Streaks(TypedDict):
    """The confirmation counts a Decision carries (its `breach_streak`, `headroom_streak`)."""

    breach_streak: int
    headroom_streak: int


def _unit(spec: Spec, lane: str) -> str:
    return COLOCATED if spec.topology == COLOCATED else lane


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}ms"


def decide(spec: Spec, observed: Observed, current: Current) -> Decision:
    auto = spec.autoscaling
    now, knobs = current.now, current.knobs
    streaks = Streaks(breach_streak=current.breach_streak, headroom_streak=current.headroom_streak)

    clamps = tuple(
        Scale(u, r, min(max(r, spec.bounds(u).min), spec.bounds(u).max))
        for u in spec.units()
        for r in [current.replicas.get(u, spec.bounds(u).replicas)]
        if not spec.bounds(u).min <= r <= spec.bounds(u).max
    )
    if clamps:
        return Decision(
            "clamp",
            "replicas outside spec bounds: "
            + ", ".join(f"{s.unit} {s.from_replicas}->{s.to_replicas}" for s in clamps),
            clamps,
            **streaks,
        )
    if not auto.enabled:
        return Decision("hold", "autoscaling disabled", **streaks)
    if observed.age_s is None or observed.age_s > auto.stale_after_s:
        age = "none received" if observed.age_s is None else f"newest is {observed.age_s:.0f}s old"
        return Decision("hold", f"no fresh telemetry ({age}; staleAfterSeconds {auto.stale_after_s})", **streaks)
    if observed.idle:
        ttft_r = itl_r = 0.0
        latency = "idle: no request finished in the window, lane queues empty"
    elif observed.samples < auto.min_samples or observed.ttft_p95_s is None or observed.itl_p95_s is None:
        return Decision("hold", f"insufficient data ({observed.samples} < {auto.min_samples} samples)", **streaks)
    else:
        ttft_r = observed.ttft_p95_s * 1000 / spec.slo.ttft_p95_ms
        itl_r = observed.itl_p95_s * 1000 / spec.slo.itl_p95_ms
        latency = (
            f"TTFT p95 {_ms(observed.ttft_p95_s)}/{spec.slo.ttft_p95_ms:.0f}ms, "
            f"ITL p95 {_ms(observed.itl_p95_s)}/{spec.slo.itl_p95_ms:.0f}ms"
        )
    ttft_breach, itl_breach = ttft_r > 1.0, itl_r > 1.0

    if ttft_breach or itl_breach:
        breach, headroom = current.breach_streak + 1, 0
    elif max(ttft_r, itl_r) < auto.headroom_ratio:
        breach, headroom = 0, current.headroom_streak + 1
    else:
        return Decision("hold", f"within SLO ({latency})")
    waiting = Streaks(breach_streak=breach, headroom_streak=headroom)
    if breach and breach < auto.breach_periods:
        return Decision("hold", f"breach {breach}/{auto.breach_periods}, confirming ({latency})", **waiting)
    if headroom and headroom < auto.headroom_periods:
        return Decision("hold", f"headroom {headroom}/{auto.headroom_periods} ({latency})", **waiting)

    config_ok = current.last_config_change is None or now - current.last_config_change >= auto.config_cooldown_s

    def since_scale(unit: str) -> float:
        t = current.last_scale.get(unit)
        return math.inf if t is None else now - t

    def replicas(unit: str) -> int:
        return current.replicas.get(unit, spec.bounds(unit).replicas)

    def scale_up(lane: str) -> Scale | None:
        u = _unit(spec, lane)
        r = replicas(u)
        if r < spec.bounds(u).max and since_scale(u) >= auto.scale_up_cooldown_s:
            return Scale(u, r, r + 1)
        return None

    def lower_k() -> Knobs | None:
        if not config_ok or knobs.k_max <= spec.speculation.k_min:
            return None
        k_max = max(spec.speculation.k_min, knobs.k_max - max(1, knobs.k_max // 4))
        return dataclasses.replace(knobs, k_max=k_max, k_initial=min(knobs.k_initial, k_max))

    q = observed.queue_depth

    def growing(lane: str) -> bool:
        prev = current.prev_queue_depth.get(lane)
        return prev is not None and q.get(lane, 0.0) > prev

    acted = Streaks(breach_streak=0, headroom_streak=0)  # every action restarts the confirmation count
    base = spec_knobs(spec)
    boosted = knobs.prio_prefill > base.prio_prefill or knobs.prefill_token_budget > base.prefill_token_budget

    def restore_prefill() -> Knobs | None:
        """One step of a prefill boost undone (None: no boost in force, or cooling down)."""
        if not config_ok or not boosted:
            return None
        return dataclasses.replace(
            knobs,
            prio_prefill=max(base.prio_prefill, knobs.prio_prefill - 1),
            prefill_token_budget=max(base.prefill_token_budget, int(knobs.prefill_token_budget / 1.5)),
        )

    def restored(why: str, new: Knobs) -> Decision:
        return Decision(
            "prefill-restore",
            f"{why}: prefill priority {knobs.prio_prefill}->{new.prio_prefill}, "
            f"budget {knobs.prefill_token_budget}->{new.prefill_token_budget}",
            knobs=new,
            **acted,
        )

    if ttft_breach and itl_breach:
        ups = {s.unit: s for s in (scale_up("verify"), scale_up("prefill")) if s is not None}
        if ups:
            return Decision(
                "scale-up", f"TTFT and ITL breached ({latency}): add capacity", tuple(ups.values()), **acted
            )
        new = restore_prefill()
        if new:
            return restored(
                f"TTFT and ITL breached ({latency}), units at max or cooling down, the prefill boost costs ITL", new
            )
        new = None if knobs.adaptive else lower_k()  # adaptive: the router's k already minimises ITL
        if new:
            return Decision(
                "lower-k",
                f"TTFT and ITL breached ({latency}), units at max or cooling down: kMax {knobs.k_max}->{new.k_max}",
                knobs=new,
                **acted,
            )
        return Decision("hold", f"TTFT and ITL breached ({latency}) but at limits", at_limits=True, **waiting)

    if itl_breach:
        if growing("draft") and q.get("draft", 0.0) > q.get("verify", 0.0):
            up = scale_up("draft")
            if up:
                return Decision(
                    "scale-up",
                    f"ITL breached ({latency}) and draft queue growing ({q.get('draft', 0):.0f}): add a draft replica",
                    (up,),
                    **acted,
                )
        new = restore_prefill()
        if new:
            return restored(f"ITL breached ({latency}) with a prefill boost in force", new)
        why = "verify queue growing" if growing("verify") else "no queue growth"
        new = None if knobs.adaptive else lower_k()
        if new:
            return Decision(
                "lower-k",
                f"ITL breached ({latency}), {why}, fixed k: kMax {knobs.k_max}->{new.k_max}",
                knobs=new,
                **acted,
            )
        if knobs.adaptive or knobs.k_max <= spec.speculation.k_min:
            up = scale_up("verify")
            if up:
                k_note = "k is the router's (adaptive)" if knobs.adaptive else f"kMax at floor {knobs.k_max}"
                return Decision("scale-up", f"ITL breached ({latency}), {k_note}: add a verify replica", (up,), **acted)
        return Decision("hold", f"ITL breached ({latency}) but at limits or cooling down", at_limits=True, **waiting)

    if ttft_breach:
        if config_ok and itl_r < auto.headroom_ratio:  # a larger prefill budget spends ITL headroom
            prio = min(knobs.prio_prefill + 1, knobs.prio_verify)
            budget = min(int(knobs.prefill_token_budget * 1.5), spec.prefill_token_budget_max)
            if (prio, budget) != (knobs.prio_prefill, knobs.prefill_token_budget):
                new = dataclasses.replace(knobs, prio_prefill=prio, prefill_token_budget=budget)
                return Decision(
                    "prefill-boost",
                    f"TTFT breached ({latency}): prefill priority "
                    f"{knobs.prio_prefill}->{prio}, budget {knobs.prefill_token_budget}->{budget}",
                    knobs=new,
                    **acted,
                )
        up = scale_up("prefill")
        if up:
            return Decision("scale-up", f"TTFT breached ({latency}): add a prefill replica", (up,), **acted)
        return Decision("hold", f"TTFT breached ({latency}) but at limits or cooling down", at_limits=True, **waiting)

    # Headroom, confirmed: relax in the reverse order of tightening.
    if config_ok and knobs.k_max < base.k_max:
        k_max = knobs.k_max + 1
        new = dataclasses.replace(knobs, k_max=k_max, k_initial=min(base.k_initial, k_max))
        return Decision("raise-k", f"headroom ({latency}): kMax {knobs.k_max}->{k_max}", knobs=new, **acted)
    new = restore_prefill()
    if new:
        return restored(f"headroom ({latency})", new)
    candidates = [
        u for u in spec.units() if replicas(u) > spec.bounds(u).min and since_scale(u) >= auto.scale_down_cooldown_s
    ]
    if candidates:

        def load(u: str) -> float:
            lanes = [u] if u != COLOCATED else list(q)
            return sum(q.get(lane, 0.0) for lane in lanes) / replicas(u)

        u = min(candidates, key=lambda c: (load(c), c))
        return Decision(
            "scale-down",
            f"headroom ({latency}): remove a {u} replica",
            (Scale(u, replicas(u), replicas(u) - 1),),
            **acted,
        )
    return Decision("hold", f"headroom ({latency}), nothing to relax", **waiting)
