"""The fit and shift kernels (model.verify_fit, model.verdict_shift) are launched outside the CUDA graphs,
so Triton compiles each of their variants the first time a call meets it (~0.16 s mid-step on an H200).
Start-up launches each variant once (GraphRunner.compile_fit_variants, EagleGraphs.compile_shift_variants):
these tests check that the launches cover every variant a call can take (BLOCK, and the integer class
Triton specializes the query by) and write nothing."""

from __future__ import annotations

import pytest
import torch
from engine_cases import write_head
from engine_helpers import make_engine

from verifypd.model.eagle_chain import EagleGraphs
from verifypd.model.graph_runner import GraphRunner
from verifypd.model.verify_fit import kernel_block, kernel_variant, variant_queries


@pytest.mark.parametrize("max_query", [1, 2, 3, 5, 8, 9, 15, 16, 17, 33])
def test_variant_queries_take_every_variant_once(max_query):
    variants = [kernel_variant(q) for q in variant_queries(max_query)]
    assert sorted(variants) == sorted({kernel_variant(q) for q in range(1, max_query + 1)})
    assert all(1 <= q <= max_query for q in variant_queries(max_query))
    if max_query >= 16:  # 16 takes BLOCK 16 as 9-15 do, but is an integer of another class
        assert (16, "16k") in variants and (16, "n") in variants


@pytest.fixture(scope="module")
def engine(tiny_models, tmp_path_factory):
    head = write_head(tiny_models, tmp_path_factory.mktemp("variants") / "head")
    return make_engine(tiny_models[0], head, k=3)


def test_fit_variants_cover_both_row_parities_and_write_nothing(engine):
    target = engine.verify_lane.target
    runner = GraphRunner(
        target.model, target.pool.tensor, target.block_size, target.staging, buckets=(1, 2, 4, 8), replay="eager"
    )
    before = (runner._meta.clone(), runner.verdict.clone())
    launched = runner.compile_fit_variants(9)
    # fit_layout's ks view starts rows * 8 bytes in: an odd and an even row count, each BLOCK
    assert {rows % 2 for rows, _ in launched} == {0, 1}
    for parity in (0, 1):
        assert {kernel_block(q) for rows, q in launched if rows % 2 == parity} == {2, 4, 8, 16}
    assert torch.equal(runner._meta, before[0]) and torch.equal(runner.verdict, before[1])


def test_shift_variants_cover_every_block_and_write_nothing(engine):
    """The kernel itself (use_triton: interpreted on the CPU) over static buffers full of values."""
    draft = engine.draft_lane.runner
    graphs = EagleGraphs(
        draft.model,
        draft.pool.tensor,
        draft.features,
        draft.block_size,
        draft.staging,
        buckets=(1, 2, 4, 8),
        replay="eager",
    )
    graphs._meta.copy_(torch.randint(0, 1000, graphs._meta.shape, generator=torch.Generator().manual_seed(1)))
    before = graphs._meta.clone()
    queries = graphs.compile_shift_variants(9)
    assert {kernel_block(q) for q in queries} == {2, 4, 8, 16}
    vrows = graphs.inputs(1, 1).vrows
    assert torch.equal(vrows, torch.full_like(vrows, -1))  # marked unfitted: nothing else changes
    vrows.copy_(before[graphs._offsets["vrows"] : graphs._offsets["vrows"] + vrows.numel()])
    assert torch.equal(graphs._meta, before)
