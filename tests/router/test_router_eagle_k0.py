"""An EAGLE draft while the adaptive policy has turned drafting off (k = 0): its plain steps chain
like `--no-speculation`'s (steps.overlapped: the next step launched before the current one's tokens
reach the host), and call no draft lane. A step that cannot chain costs a whole host round trip on
the GPU; the head's catch-up waits for the next drafting step (its features are written by every
target forward). SIMULATED acceptance 0, so that the policy turns drafting off whatever the head."""

from __future__ import annotations

import pytest
from engine_cases import write_head
from engine_helpers import make_engine
from test_router_overlap import costed_clock, drive, prompts

from verifypd.domain.requests import RequestSpec


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    return write_head(tiny_models, tmp_path_factory.mktemp("eagle_k0") / "head")


def _specs() -> list[RequestSpec]:
    return [RequestSpec(p, max_tokens=90, stop_at_eos=False, request_id=f"e{i}") for i, p in enumerate(prompts(6, 71))]


def _count_draft_calls(engine) -> list[int]:
    """Wraps the draft lane's calls (in their own step, and launched after a verify call); a counter."""
    calls = [0]
    lane = engine.router.draft_lane
    for name in ("draft", "draft_after"):
        call = getattr(lane, name, None)
        if call is None:
            continue

        def counted(*args, _call=call, **kwargs):
            calls[0] += 1
            return _call(*args, **kwargs)

        setattr(lane, name, counted)
    return calls


def test_eagle_k0_steps_chain_like_plain_decoding(tiny_models, head):
    plain = make_engine(tiny_models[0], "none", k=0, num_blocks=512)
    costed_clock(plain.router)
    plain_out, _, plain_router = drive(plain, _specs(), overlap=True)

    eagle = make_engine(tiny_models[0], head, k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    costed_clock(eagle.router)
    draft_calls = _count_draft_calls(eagle)
    out, _, router = drive(eagle, _specs(), overlap=True)

    assert {r: o[0] for r, o in out.items()} == {r: o[0] for r, o in plain_out.items()}
    probes = router.scheduler.probes
    off = probes.decisions - probes.drafting - probes.probes
    assert off > 60, (off, probes.k_counts)
    # The plain engine chains every step but the first of the batch; the head's engine chains every
    # k = 0 step but those next to a drafting or probing step and the PLAIN_SAMPLES steps' end.
    assert plain_router.overlap.steps >= 85, plain_router.overlap.steps
    assert router.overlap.steps >= off - 6, (router.overlap.steps, off, router.overlap.breaks)
    # Drafting calls come only from the steps that draft (the opening, probes), none from k = 0 steps.
    assert draft_calls[0] <= probes.drafting + probes.probes + 2, (draft_calls[0], probes.k_counts)
