"""Overlapped plain decoding (RuntimeConfig.overlap, verifypd.router.overlap): the next k = 0 step is
launched before the current one's tokens reach the host, its pending tokens fed on the device.
Every test runs the same requests with overlap off and on, driving `Router.step()` by hand so that
arrivals, cancels and config changes land between the same steps, and wants the same stream of
chunks (tokens, text, finish reasons) — and checks that the overlapped path actually ran."""

from __future__ import annotations

import dataclasses
import random

import pytest
from engine_helpers import VOCAB, costed_clock, hf_greedy, make_engine

from verifypd.domain.requests import FinishReason, RequestSpec, SamplingParams


def prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 20))) for _ in range(n)]


def make_specs(n: int = 10, seed: int = 5, stop: dict[int, list[str]] | None = None) -> list[RequestSpec]:
    out = []
    for i, p in enumerate(prompts(n, seed)):
        sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i) if i % 4 == 3 else SamplingParams()
        out.append(
            RequestSpec(
                p,
                max_tokens=6 + (7 * i) % 23,
                stop_at_eos=True,
                request_id=f"q{i}",
                sampling=sampling,
                stop=(stop or {}).get(i, []),
            )
        )
    return out


def drive(engine, specs, *, overlap: bool, eos=None, arrive=None, cancel=None, configs=None):
    """Runs `specs` to the end, one `router.step()` per loop; `arrive`: {step: [spec index]} (the
    rest arrive at step 0), `cancel`: {step: [request id]}, `configs`: {step: RuntimeConfig changes},
    each applied before that step. Returns ({id: (tokens, text, finish)}, chunks in order, router)."""
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=overlap)
    if eos is not None:
        router.context.eos = frozenset(eos)
    later = {i for idx in (arrive or {}).values() for i in idx}
    for i, spec in enumerate(specs):
        if i not in later:
            router.add_request(spec)
    done: dict[str, list] = {}
    chunks = []
    step = 0
    while router.has_work() or any(s > step for s in (arrive or {})):
        for i in (arrive or {}).get(step, []):
            router.add_request(specs[i])
        for rid in (cancel or {}).get(step, []):
            out = router.abort(rid)
            if out is not None:
                chunks.append((step, out.request_id, tuple(out.token_ids), out.finished, out.finish_reason))
                done.setdefault(rid, [[], "", None])[2] = out.finish_reason
        if step in (configs or {}):
            router.config = router.config.updated(**configs[step])
        for out in router.step():
            chunks.append((step, out.request_id, tuple(out.token_ids), out.finished, out.finish_reason))
            entry = done.setdefault(out.request_id, [[], "", None])
            entry[0] += out.token_ids
            entry[1] += out.text
            if out.finished:
                entry[2] = out.finish_reason
        step += 1
        assert step < 2000
    router.close()
    return {k: (tuple(v[0]), v[1], v[2]) for k, v in done.items()}, chunks, router


def matches_transformers(hf_target, specs, got) -> int:
    """Compares with transformers' greedy decoding the outputs that hold no EOS (id 2: the reference
    suppresses it to produce max_tokens); returns how many were compared."""
    compared = 0
    for spec in specs:
        ours = list(got[spec.request_id][0])
        if 2 not in ours:
            assert ours == hf_greedy(hf_target, list(spec.prompt_ids), spec.max_tokens), spec.request_id
            compared += 1
    return compared


def check_blocks_returned(router):
    assert router.target_blocks.num_free == router.target_blocks.num_blocks
    if router.draft_blocks is not None:
        assert router.draft_blocks.num_free == router.draft_blocks.num_blocks


def fresh(tiny_models, **kw):
    kw.setdefault("k", 0)
    return make_engine(*tiny_models, **kw)


def test_overlap_same_chunks_with_eos_length_and_stop_strings(tiny_models):
    base, _, _ = drive(fresh(tiny_models), make_specs(), overlap=False)
    # An EOS that really occurs mid-generation in several requests, and stop strings from the text.
    counts: dict[int, int] = {}
    for toks, _, _ in base.values():
        for t in toks[1:-1]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    words = {i: [base[f"q{i}"][1].split()[2]] for i in (1, 4, 6) if len(base[f"q{i}"][1].split()) > 3}
    specs = make_specs(stop=words)
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, eos=(eos,))
    got, got_chunks, router = drive(fresh(tiny_models), specs, overlap=True, eos=(eos,))
    assert got == want and got_chunks == want_chunks
    reasons = {v[2] for v in got.values()}
    assert {FinishReason.EOS, FinishReason.LENGTH} <= reasons and (not words or FinishReason.STOP in reasons)
    assert router.overlap.steps > 10, "the overlapped path never ran"
    assert router.overlap.dropped > 0, "no request finished after the fact (a row dropped at commit)"
    check_blocks_returned(router)


def test_overlap_greedy_matches_transformers(tiny_models, hf_target):
    specs = [
        RequestSpec(p, max_tokens=12 + i, stop_at_eos=False, request_id=f"h{i}") for i, p in enumerate(prompts(8, 11))
    ]
    got, _, router = drive(fresh(tiny_models), specs, overlap=True)
    assert matches_transformers(hf_target, specs, got) >= 2
    assert router.overlap.steps > 5


def test_overlap_cancels_between_steps_same_chunks(tiny_models):
    """A cancel lands between two calls, while the next step is already launched: its row is dropped
    at commit, so every stream is chunk for chunk the one without overlap."""
    specs = make_specs(12, seed=8)
    plan = dict(cancel={2: ["q0"], 5: ["q3", "q9"], 9: ["q11"], 12: ["q5"]})
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, **plan)
    got, got_chunks, router = drive(fresh(tiny_models), specs, overlap=True, **plan)
    assert got == want and got_chunks == want_chunks
    assert sum(v[2] is FinishReason.CANCELLED for v in got.values()) >= 4
    assert router.overlap.steps > 5 and router.overlap.dropped > 0
    check_blocks_returned(router)


def test_overlap_arrivals_and_cancels_between_steps(tiny_models):
    """A request arriving while a step is in flight is prefilled after that step (one step later by
    count than without overlap, not later in time: that step was already running). Tokens of every
    request that ran to its end are the same; a cancelled one's are a prefix of its full output."""
    specs = make_specs(12, seed=8)
    plan = dict(arrive={3: [9], 7: [10, 11]}, cancel={2: ["q0"], 5: ["q3", "q9"], 9: ["q11"], 12: ["q5"]})
    full, _, _ = drive(fresh(tiny_models), specs, overlap=False, arrive=plan["arrive"])
    want, _, _ = drive(fresh(tiny_models), specs, overlap=False, **plan)
    got, _, router = drive(fresh(tiny_models), specs, overlap=True, **plan)
    assert got.keys() == want.keys()
    for rid, (tokens, text, finish) in got.items():
        if want[rid][2] is FinishReason.CANCELLED:
            assert finish is FinishReason.CANCELLED and full[rid][0][: len(tokens)] == tokens, rid
        else:
            assert (tokens, text, finish) == want[rid], rid
    assert sum(v[2] is FinishReason.CANCELLED for v in got.values()) >= 4
    assert router.overlap.steps > 5
    check_blocks_returned(router)


def test_cancelled_requests_blocks_wait_for_the_step_in_flight(tiny_models):
    """A request cancelled while a launched step still holds its row: its blocks must not return
    to the pool (where a new request could get them) until that step's results are in."""
    engine = fresh(tiny_models)
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=True)
    for spec in make_specs(4, seed=2):
        router.add_request(dataclasses.replace(spec, max_tokens=40, stop_at_eos=False, sampling=SamplingParams()))
    for _ in range(4):
        router.step()
    inflight = router.overlap.inflight
    assert inflight is not None and "q1" in inflight.members
    free_before = router.target_blocks.num_free
    held = len(next(s for s in router.sequences() if s.request_id == "q1").target_blocks)
    router.abort("q1")
    assert router.target_blocks.num_free == free_before, "blocks freed under a step still in flight"
    router.step()  # commits that step (launching the next one first)
    assert router.target_blocks.num_free >= free_before + held - len(router.sequences())
    assert "q1" not in router.overlap.inflight.members
    while router.has_work():
        router.step()
    check_blocks_returned(router)


def test_overlap_under_block_pressure_preempts_like_the_plain_path(tiny_models):
    specs = [RequestSpec(p, max_tokens=30, stop_at_eos=False, request_id=f"p{i}") for i, p in enumerate(prompts(6, 21))]
    want, want_chunks, plain_router = drive(fresh(tiny_models, num_blocks=40), specs, overlap=False)
    got, got_chunks, router = drive(fresh(tiny_models, num_blocks=40), specs, overlap=True)
    assert got == want and got_chunks == want_chunks
    assert router.overlap.steps > 5
    check_blocks_returned(router)


def test_preemption_happens_in_the_pressure_test(tiny_models):
    """The block-pressure test above is only worth something if the pool really forces preemption."""
    engine = fresh(tiny_models, num_blocks=40)
    specs = [RequestSpec(p, max_tokens=30, stop_at_eos=False, request_id=f"p{i}") for i, p in enumerate(prompts(6, 21))]
    preempted = []
    engine.router.observer.on_request_finished = lambda seq: preempted.append(seq.stats.preemptions)
    drive(engine, specs, overlap=True)
    assert sum(preempted) > 0


@pytest.mark.slow
def test_overlap_mixed_with_speculative_steps(tiny_models, hf_target):
    """The config switches between plain decoding and drafting (k = 3) every few steps: chains start
    and end around speculative steps, tokens stay the target's greedy ones."""
    specs = [
        RequestSpec(p, max_tokens=24, stop_at_eos=False, request_id=f"m{i}", max_k=None if i % 3 else 0)
        for i, p in enumerate(prompts(6, 33))
    ]
    configs = {
        s: ({"k_initial": 3, "k_max": 8} if (s // 5) % 2 else {"k_initial": 0, "k_max": 8}) for s in range(0, 40, 5)
    }
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, configs=configs)
    got, got_chunks, router = drive(fresh(tiny_models), specs, overlap=True, configs=configs)
    assert got == want
    assert matches_transformers(hf_target, specs, got) >= 2
    assert router.overlap.steps > 5
    assert router.scheduler.probes.drafting > 3, "no speculative steps between the chains"
    check_blocks_returned(router)


@pytest.mark.parametrize("flag,overlap,ahead", [("off", False, False), ("on", True, False), ("ahead", True, True)])
def test_overlap_flag_reaches_the_config(flag, overlap, ahead):
    from verifypd.cli import build_parser
    from verifypd.launch.serve_args import engine_options

    config = engine_options(build_parser().parse_args(["serve", "--overlap", flag])).config
    assert (config.overlap, config.admit_ahead) == (overlap, ahead)
    assert engine_options(build_parser().parse_args(["serve"])).config.admit_ahead is False


@pytest.mark.slow
def test_adaptive_k_switched_off_keeps_chaining_when_no_probe_can_run(tiny_models):
    """Adaptive k that turned drafting off (SIMULATED acceptance 0) chains its plain steps. A probe
    falls due after PROBE_FIRST steps off, but only a request whose draft KV is at most PROBE_MAX_LAG
    behind can be probed; here none is, so a probe can never run, and the chain must not wait for one
    (it did: 24 of 127 steps chained at batch 1 on the H200, against 126 with k fixed at 0)."""
    engine = make_engine(*tiny_models, k=2, adaptive=True, simulated_acceptance=0.0)
    costed_clock(engine.router)
    specs = [
        RequestSpec(p, max_tokens=110, stop_at_eos=False, request_id=f"a{i}") for i, p in enumerate(prompts(3, 44))
    ]
    _, _, router = drive(engine, specs, overlap=True)
    probes = router.scheduler.probes
    assert probes.due and probes.probes == 0, "the scenario needs a probe due that no request can take"
    off = probes.decisions - probes.drafting
    assert off > 70 and router.overlap.steps >= 0.8 * off, (router.overlap.steps, off)


@pytest.mark.slow
def test_adaptive_k_switched_off_keeps_chaining_as_the_batch_shrinks(tiny_models):
    """Drafting off (SIMULATED acceptance 0), requests finishing one after another: a finish changes
    the batch the off decision was made for, and the chained step decides again for the smaller
    batch instead of ending the chain for a regular step (which it did at every finish: ngram at
    batch 16 ran at 0.91 x plain decoding on the H200, hardly drafting)."""
    from verifypd.router.step_costs import batch_bucket

    engine = make_engine(*tiny_models, k=2, adaptive=True, simulated_acceptance=0.0)
    costed_clock(engine.router)
    specs = [
        RequestSpec(p, max_tokens=60 + 8 * i, stop_at_eos=False, request_id=f"s{i}")
        for i, p in enumerate(prompts(6, 44))
    ]
    _, _, router = drive(engine, specs, overlap=True)
    probes = router.scheduler.probes
    off = probes.decisions - probes.drafting
    assert off > 60, (off, probes.decisions)
    # Six requests finish at six different steps (the batch shrinks 5 times while drafting is off),
    # through 4 batch buckets (8, 4, 2, 1): a chain may end where the plain cost of a new bucket is
    # unmeasured, and for a probe, not at every finish (13 "plan" breaks before, 5 after). Plain
    # decoding is measured over PLAIN_SAMPLES chained steps: the chain then ends once
    # more per bucket, where the measurement completes and drafting is decided anew (7).
    buckets = len({batch_bucket(n) for n in range(1, 7)})
    assert router.overlap.breaks.get("plan", 0) <= 2 * buckets + 1 + probes.probes, router.overlap.breaks


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_step_cost_leaves_out_host_work_that_overlap_hides(tiny_models, overlap):
    """Adaptive k compares drafting with plain decoding by their measured step costs. With overlap a
    plain step's host work (commit, stream, plan) runs while the GPU works on the next step, so a
    regular plain step must be costed without it, or the policy drafts where plain decoding is faster
    (SIMULATED α 0.7 at batch 64 on the H200: 0.91 × overlapped plain). Here the host work is a slow
    observer (0.3 s a step): it counts in the plain step's cost without overlap, not with it."""
    import time

    engine = fresh(tiny_models)
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=overlap)
    seen = []
    router.costs.observe_step = lambda batch, k, seconds: seen.append((batch, k, seconds))
    on_step = router.observer.on_step
    router.observer.on_step = lambda r: (time.sleep(0.3), on_step(r))
    router.add_request(RequestSpec(prompts(1, 3)[0], max_tokens=2, stop_at_eos=False, request_id="c0"))
    while router.has_work():
        router.step()
    router.close()
    plain = [s for b, k, s in seen if k == 0]
    assert plain, seen
    assert all(s < 0.3 for s in plain) if overlap else all(s >= 0.3 for s in plain), seen
