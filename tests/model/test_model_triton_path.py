"""The fast path's pieces on CPU: the whole engine through the Triton kernels (interpreter) must
produce the same greedy tokens as the torch reference, at k = 0 and with speculation; and the
padded batch layouts that CUDA graphs replay are checked entry by entry."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from engine_helpers import DEVICE, make_engine
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model import layout as layout_module
from verifypd.model.runner import TokenRun, build_layout

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)


def _outputs(engine, prompts):
    done = engine.generate([RequestSpec(p, max_tokens=10, stop_at_eos=False) for p in prompts])
    return [c.token_ids for c in done.values()]


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("k", [0, 3])
def test_triton_backend_equals_reference(tiny_models, monkeypatch, k):
    pytest.importorskip("triton")
    prompts = random_prompts(3, seed=11, max_len=40)  # contexts cross 4-token blocks many times
    monkeypatch.setenv("VERIFYPD_ATTENTION", "reference")
    expected = _outputs(make_engine(*tiny_models, k=k), prompts)
    monkeypatch.setenv("VERIFYPD_ATTENTION", "triton")
    engine = make_engine(*tiny_models, k=k)
    assert engine.models.target_model.attention == "triton"
    assert _outputs(engine, prompts) == expected


@pytest.fixture(params=["python", "numpy"])
def padded_path(request, monkeypatch):
    """Both builders of padded layouts: small ones element by element, larger ones with numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(layout_module, "SMALL_PADDED", -1)
    return request.param


def test_padded_layout_left_and_right_aligned(padded_path):
    runs = [TokenRun([7, 8, 9], 5, (3, 1)), TokenRun([4], 2, (6,))]
    left = build_layout(runs, 4, query=3, align="left", rows=4, width=3)
    # Run 0: positions 5, 6, 7 -> block 1 (slot 4..7 of block id 1); run 1: one token then padding.
    assert left.ids.reshape(4, 3).tolist() == [[7, 8, 9], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert left.positions.reshape(4, 3).tolist()[:2] == [[5, 6, 7], [2, 2, 2]]
    assert left.slots.reshape(4, 3).tolist() == [[5, 6, 7], [26, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert left.query_start.tolist() == [0, 3, 6, 9, 12]
    assert left.tables.tolist()[:2] == [[3, 1, 0], [6, 0, 0]]
    right = build_layout(runs, 4, query=3, align="right", rows=2, width=2)
    # The last real token is always row Q - 1; padding in front repeats the first position.
    assert right.ids.reshape(2, 3).tolist() == [[7, 8, 9], [0, 0, 4]]
    assert right.positions.reshape(2, 3).tolist() == [[5, 6, 7], [2, 2, 2]]
    assert right.slots.reshape(2, 3).tolist() == [[5, 6, 7], [-1, -1, 26]]


def test_small_padded_layouts_equal_the_numpy_builder(monkeypatch):
    """Random padded layouts (decode / verify / draft sizes) built element by element == numpy's."""
    rng = random.Random(7)
    cases = 0
    while cases < 400:
        query, block_size = rng.randint(1, 9), rng.choice([1, 4, 16])
        runs = []
        for _ in range(rng.randint(1, 6)):
            n, start = rng.randint(1, query), rng.randint(0, 40)
            blocks = -(-(start + n) // block_size) + rng.randint(0, 2)
            runs.append(TokenRun([rng.randint(1, 99) for _ in range(n)], start, tuple(rng.sample(range(200), blocks))))
        rows = len(runs) + rng.randint(0, 3)
        if rows * query > layout_module.SMALL_PADDED:
            continue
        kwargs = dict(query=query, align=rng.choice(["left", "right"]), rows=rows, width=rng.choice([None, 60]))
        small = build_layout(runs, block_size, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(layout_module, "SMALL_PADDED", -1)
            reference = build_layout(runs, block_size, **kwargs)
        for field in ("ids", "positions", "slots", "tables", "query_start"):
            a, b = getattr(small, field), getattr(reference, field)
            assert a.dtype == b.dtype and np.array_equal(a, b), (field, runs, kwargs)
        assert (small.max_query, small.real) == (reference.max_query, reference.real)
        cases += 1


def test_ragged_layout_and_capacity_errors(padded_path):
    runs = [TokenRun([1, 2], 0, (0,)), TokenRun([3, 4, 5], 4, (2, 5))]
    ragged = build_layout(runs, 4)
    assert ragged.ids.tolist() == [1, 2, 3, 4, 5]
    assert ragged.positions.tolist() == [0, 1, 4, 5, 6]
    assert ragged.slots.tolist() == [0, 1, 20, 21, 22]
    assert ragged.query_start.tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="holds 1 blocks"):
        build_layout([TokenRun([1] * 5, 0, (0,))], 4)
    with pytest.raises(ValueError, match="query slots"):
        build_layout(runs, 4, query=2)
    assert np.array_equal(build_layout(runs, 4, query=3, rows=2).query_start, [0, 3, 6])
