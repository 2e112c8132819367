"""Table tests of the autoscaling policy (pure; no clock, no I/O)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from verifypd_operator.decision import Current, Observed, Scale, clamp_knobs, decide, spec_knobs
from verifypd_operator.spec import parse_spec

SLO = {"ttftP95Ms": 500, "itlP95Ms": 50}


def mk_spec(topology="split", adaptive=True, **auto):
    a = {
        "breachPeriods": 1,
        "headroomPeriods": 1,
        "scaleUpCooldownSeconds": 60,
        "scaleDownCooldownSeconds": 300,
        "configCooldownSeconds": 30,
        "minSamples": 10,
        **auto,
    }
    return parse_spec(
        {
            "topology": topology,
            "slo": SLO,
            "autoscaling": a,
            "speculation": {"kMin": 1, "kInitial": 4, "kMax": 8, "adaptive": adaptive},
            "lanes": {
                lane: {"replicas": 1, "minReplicas": 1, "maxReplicas": 3} for lane in ("prefill", "draft", "verify")
            },
            "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3},
        }
    )


def obs(ttft_ms, itl_ms, samples=100, **queues):
    return Observed(ttft_ms / 1000, itl_ms / 1000, samples, queues)


def cur(spec, now=10_000.0, replicas=None, **kw):
    knobs = kw.pop("knobs", spec_knobs(spec))
    reps = replicas or {u: 1 for u in spec.units()}
    return Current(now=now, replicas=reps, knobs=knobs, **kw)


OK, ITL_HI, TTFT_HI, HEADROOM = (300, 40), (300, 80), (900, 20), (100, 10)


@pytest.mark.parametrize(
    "name, observed, current_kw, expect_action, expect",
    [
        ("within SLO holds", obs(*OK), {}, "hold", None),
        ("too few samples holds", obs(*ITL_HI, samples=3), {}, "hold", None),
        (
            "ITL breach, fixed k, verify queue growing: lower kMax before scaling",
            obs(*ITL_HI, verify=9.0),
            {"prev_queue_depth": {"verify": 4.0}, "fixed_k": True},
            "lower-k",
            ("k_max", 6),
        ),
        (
            "ITL breach, fixed k, kMax at floor: add verify replica",
            obs(*ITL_HI, verify=9.0),
            {"prev_queue_depth": {"verify": 4.0}, "knobs_k_max": 1, "fixed_k": True},
            "scale-up",
            Scale("verify", 1, 2),
        ),
        (
            "ITL breach, adaptive k: k is the router's, add a verify replica (kMax untouched)",
            obs(*ITL_HI, verify=9.0),
            {"prev_queue_depth": {"verify": 4.0}},
            "scale-up",
            Scale("verify", 1, 2),
        ),
        (
            "ITL breach with a prefill boost in force: undo it first",
            obs(*ITL_HI),
            {"knobs_prefill": (1, 1152)},
            "prefill-restore",
            ("prefill_token_budget", 768),
        ),
        (
            "ITL breach, fixed k, prefill boost in force: undo it before lowering k",
            obs(*ITL_HI),
            {"knobs_prefill": (1, 768), "fixed_k": True},
            "prefill-restore",
            ("prio_prefill", 0),
        ),
        (
            "ITL breach, draft queue growing and longest: add draft replica",
            obs(*ITL_HI, draft=12.0, verify=2.0),
            {"prev_queue_depth": {"draft": 5.0}},
            "scale-up",
            Scale("draft", 1, 2),
        ),
        ("TTFT breach: lower prefill penalty first", obs(*TTFT_HI), {}, "prefill-boost", ("prio_prefill", 1)),
        (
            "TTFT breach, ITL without headroom: no prefill boost (it spends ITL), add a prefill replica",
            obs(900, 40),
            {},
            "scale-up",
            Scale("prefill", 1, 2),
        ),
        (
            "TTFT breach, penalty and budget exhausted: add prefill replica",
            obs(*TTFT_HI),
            {"knobs_prefill": (1, 4096)},
            "scale-up",
            Scale("prefill", 1, 2),
        ),
        ("both breached: add capacity", obs(900, 80), {}, "scale-up", Scale("verify", 1, 2)),
        ("headroom: raise k back first", obs(*HEADROOM), {"knobs_k_max": 5}, "raise-k", ("k_max", 6)),
        (
            "headroom: restore prefill priority",
            obs(*HEADROOM),
            {"knobs_prefill": (1, 768)},
            "prefill-restore",
            ("prio_prefill", 0),
        ),
        (
            "headroom: scale down the least loaded unit",
            obs(*HEADROOM, prefill=0.0, draft=3.0, verify=5.0),
            {"replicas": {"prefill": 2, "draft": 2, "verify": 2}},
            "scale-down",
            Scale("prefill", 2, 1),
        ),
        ("headroom at min replicas: nothing to do", obs(*HEADROOM), {}, "hold", None),
        (
            "idle (fresh, nothing finished, queues empty) counts as headroom",
            Observed(samples=0, queue_depth={"prefill": 0.0, "draft": 0.0, "verify": 0.0}),
            {"knobs_k_max": 5},
            "raise-k",
            ("k_max", 6),
        ),
        (
            "nothing finished but requests queued: not idle, too few samples",
            Observed(samples=0, queue_depth={"prefill": 0.0, "draft": 3.0, "verify": 3.0}),
            {"knobs_k_max": 5},
            "hold",
            None,
        ),
        ("no queue signal at all: not idle", Observed(samples=0), {"knobs_k_max": 5}, "hold", None),
        ("stale telemetry: no decision on it", dataclasses.replace(obs(*ITL_HI), age_s=21.0), {}, "hold", None),
        ("no telemetry ever", dataclasses.replace(obs(*ITL_HI), age_s=None), {}, "hold", None),
        (
            "telemetry just within staleAfterSeconds acts",
            dataclasses.replace(obs(*ITL_HI), age_s=20.0),
            {},
            "scale-up",
            Scale("verify", 1, 2),
        ),
    ],
)
def test_policy_branches(name, observed, current_kw, expect_action, expect):
    spec = mk_spec()
    kw = dict(current_kw)
    knobs = spec_knobs(spec)
    if "knobs_k_max" in kw:
        knobs = dataclasses.replace(knobs, k_max=kw.pop("knobs_k_max"), k_initial=1)
    if kw.pop("fixed_k", False):
        knobs = dataclasses.replace(knobs, adaptive=False)
    if "knobs_prefill" in kw:
        prio, budget = kw.pop("knobs_prefill")
        knobs = dataclasses.replace(knobs, prio_prefill=prio, prefill_token_budget=budget)
    d = decide(spec, observed, cur(spec, knobs=knobs, **kw))
    assert d.action == expect_action, (name, d)
    if isinstance(expect, Scale):
        assert expect in d.scales
    elif expect is not None:
        field, value = expect
        assert getattr(d.knobs, field) == value
        assert not d.scales
    else:
        assert not d.changes_something


def test_both_breached_colocated_scales_the_pod_once():
    spec = mk_spec(topology="colocated")
    d = decide(spec, obs(900, 80), cur(spec))
    assert d.scales == (Scale("colocated", 1, 2),)


def test_lower_k_keeps_k_initial_within_bounds_and_floor():
    spec = mk_spec(adaptive=False)
    knobs = spec_knobs(spec)
    seen = []
    for _ in range(10):
        d = decide(spec, obs(*ITL_HI), cur(spec, knobs=knobs))
        if d.knobs is None:
            break
        knobs = d.knobs
        assert knobs.k_min <= knobs.k_initial <= knobs.k_max
        seen.append(knobs.k_max)
    assert seen == [6, 5, 4, 3, 2, 1]  # never below spec kMin


@pytest.mark.parametrize("since, allowed", [(59, False), (60, True)])
def test_scale_up_cooldown(since, allowed):
    spec = mk_spec()
    knobs = dataclasses.replace(spec_knobs(spec), k_max=1, k_initial=1)
    d = decide(spec, obs(*ITL_HI), cur(spec, knobs=knobs, last_scale={"verify": 10_000.0 - since}))
    assert (d.action == "scale-up") is allowed
    if not allowed:
        assert d.at_limits


@pytest.mark.parametrize("since, allowed", [(299, False), (300, True)])
def test_scale_down_cooldown(since, allowed):
    spec = mk_spec()
    d = decide(
        spec,
        obs(*HEADROOM),
        cur(spec, replicas={"prefill": 1, "draft": 1, "verify": 2}, last_scale={"verify": 10_000.0 - since}),
    )
    assert (d.action == "scale-down") is allowed


def test_config_cooldown_blocks_k_change_then_scales_only_at_floor():
    spec = mk_spec(adaptive=False)
    d = decide(spec, obs(*ITL_HI), cur(spec, last_config_change=10_000.0 - 5))
    assert d.action == "hold" and d.knobs is None  # kMax not at floor: wait rather than scale


def test_max_replicas_bound_and_clamp_on_spec_change():
    spec = mk_spec()
    knobs = dataclasses.replace(spec_knobs(spec), k_max=1, k_initial=1)
    d = decide(spec, obs(*ITL_HI), cur(spec, knobs=knobs, replicas={"prefill": 1, "draft": 1, "verify": 3}))
    assert d.action == "hold" and d.at_limits and not d.scales
    # Spec lowered maxReplicas below the running count: clamp immediately, ignoring cooldowns.
    d = decide(
        spec, obs(*OK), cur(spec, replicas={"prefill": 1, "draft": 1, "verify": 5}, last_scale={"verify": 10_000.0})
    )
    assert d.action == "clamp" and d.scales == (Scale("verify", 5, 3),)


def test_hysteresis_requires_consecutive_breaches():
    spec = mk_spec(breachPeriods=3)
    c = cur(spec)
    actions = []
    for _ in range(3):
        d = decide(spec, obs(*ITL_HI), c)
        actions.append(d.action)
        c = dataclasses.replace(c, breach_streak=d.breach_streak, headroom_streak=d.headroom_streak)
    assert actions == ["hold", "hold", "scale-up"]
    assert c.breach_streak == 0  # the count restarts after acting


def test_no_flapping_on_noisy_input():
    """p95 jittering around the SLO (±30 %) and the headroom line must not make k oscillate."""
    spec = mk_spec(breachPeriods=2, headroomPeriods=3)
    rng = random.Random(7)
    c = cur(spec)
    changes = []
    for step in range(200):
        itl = 50 * rng.uniform(0.75, 1.05) if step % 2 else 50 * rng.uniform(0.6, 0.8)
        d = decide(spec, obs(300, itl), dataclasses.replace(c, now=10_000.0 + 30 * step))
        if d.knobs:
            changes.append(d.knobs.k_max - c.knobs.k_max)
            c = dataclasses.replace(c, knobs=d.knobs, last_config_change=10_000.0 + 30 * step)
        c = dataclasses.replace(c, breach_streak=d.breach_streak, headroom_streak=d.headroom_streak)
    # Alternating breach/no-breach never confirms a breach (2 in a row needed), nor headroom.
    assert changes == []


@pytest.mark.parametrize(
    "adaptive, knobs_kw, expect_action, expect_knobs",
    [
        # The measured case (docs/kubernetes.md): a prefill boost in force, both breached, the
        # pod at max. Undo the boost, the one knob that measurably cost ITL.
        (True, {"prio_prefill": 1, "prefill_token_budget": 3888}, "prefill-restore", (8, 0, 2592)),
        # No boost left, adaptive k: the router's k already minimises ITL; lowering kMax would raise it.
        (True, {}, "hold", None),
        # No boost left, fixed k: fewer drafts shorten each step.
        (False, {}, "lower-k", (6, 0, 512)),
    ],
)
def test_both_breached_at_max_replicas(adaptive, knobs_kw, expect_action, expect_knobs):
    spec = mk_spec(topology="colocated", adaptive=adaptive)
    knobs = dataclasses.replace(spec_knobs(spec), **knobs_kw)
    d = decide(spec, obs(900, 80), cur(spec, knobs=knobs, replicas={"colocated": 3}))
    assert d.action == expect_action and not d.scales, d
    if expect_knobs is None:
        assert d.knobs is None and d.at_limits
    else:
        assert (d.knobs.k_max, d.knobs.prio_prefill, d.knobs.prefill_token_budget) == expect_knobs


def test_adaptive_k_is_never_lowered_under_itl_breach():
    """Whatever the ITL breach and the queues, with the router's adaptive k on the policy never
    touches kMax (it scales, undoes a prefill boost, or holds at limits)."""
    spec = mk_spec()
    rng = random.Random(3)
    for _ in range(300):
        reps = {u: rng.randint(1, 3) for u in spec.units()}
        knobs = dataclasses.replace(
            spec_knobs(spec), prio_prefill=rng.choice([0, 1]), prefill_token_budget=rng.choice([512, 768, 4096])
        )
        o = obs(rng.choice([300, 900]), rng.uniform(51, 200), verify=rng.uniform(0, 9), draft=rng.uniform(0, 9))
        d = decide(
            spec,
            o,
            cur(
                spec,
                knobs=knobs,
                replicas=reps,
                prev_queue_depth={"verify": 4.0, "draft": 4.0},
                last_scale={u: 10_000.0 - rng.choice([5, 500]) for u in spec.units()},
            ),
        )
        assert d.knobs is None or d.knobs.k_max == knobs.k_max, d


def test_disabled_autoscaling_holds():
    spec = mk_spec(enabled=False)
    assert decide(spec, obs(900, 80), cur(spec)).action == "hold"


def test_clamp_knobs_keeps_adjustments_within_new_spec():
    spec = mk_spec()
    k = dataclasses.replace(spec_knobs(spec), k_max=3, prio_prefill=1, prefill_token_budget=10_000)
    narrower = parse_spec({"speculation": {"kMin": 4, "kInitial": 4, "kMax": 6}})
    c = clamp_knobs(k, narrower)
    assert (c.k_min, c.k_max, c.k_initial) == (4, 4, 4)
    assert c.prefill_token_budget == narrower.prefill_token_budget_max
