"""Published FP8 checkpoints under tensor parallelism (model.families.fp8_scale_rule). Each rank reads
only its slices of the fp8 weights and of their per-channel scales: its projections are exactly
model.tensor_parallel.shard_weights' cut of the unsharded ones, the ranks' column shards and their
scales concatenate back to the single-rank tensors, every row-parallel rank keeps the whole scale, and
the ranks together read each sliced byte once. Two ranks over gloo give the single-rank model's
logits and greedy tokens."""

from __future__ import annotations

import pathlib

import pytest
import torch
from engine_helpers import write_tiny_llama
from fp8_checkpoints import KINDS, write_fp8
from gloo_ranks import run_on_ranks
from safetensors.torch import load_file

from verifypd.model.checkpoint import SafetensorsSource
from verifypd.model.families import COLUMN_PARALLEL, shard_rule
from verifypd.model.fp8 import Fp8Weight
from verifypd.model.loader import load_model, random_shape
from verifypd.model.tensor_parallel import load_target_shard, shard_weights

CPU = torch.device("cpu")
WORLD = 2
HIDDEN = 64  # write_tiny_llama's hidden size


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """One tiny Llama (4 heads, 2 kv heads, both split over 2 ranks) in each published FP8 layout."""
    root = tmp_path_factory.mktemp("fp8tp")
    tiny = write_tiny_llama(root / "llama", seed=5, layers=2)
    for kind in KINDS:
        write_fp8(tiny, root / kind, kind)
    return {kind: str(root / kind) for kind in KINDS}


def test_fp8_scales_follow_their_weights_rows():
    shape = random_shape("tinyllama-1.1b", None)[0]  # q rows 2048, k / v rows 256, intermediate 5632
    q, kv, inter, hidden = 2048, 256, 5632, 2048
    p = "model.layers.3."
    for dims in ((q, 1), (q,)):  # per output channel: the rows of the weight's rule
        assert shard_rule(p + "self_attn.q_proj.weight_scale", shape, dims) == (0, None)
    for dims in ((1,), ()):  # per tensor: one value, the same for every row
        assert shard_rule(p + "self_attn.k_proj.weight_scale", shape, dims) is None
    # Row-parallel: every rank computes every output row, so it keeps every row's scale.
    assert shard_rule(p + "self_attn.o_proj.weight_scale", shape, (hidden, 1)) is None
    assert shard_rule(p + "mlp.down_proj.weight_scale", shape, (hidden, 1)) is None
    assert shard_rule(p + "mlp.down_proj.weight", shape, (hidden, inter)) == (1, None)
    assert shard_rule(p + "self_attn.q_proj.input_scale", shape, (1,)) is None
    # Phi-3's fused projections: the scale is cut per section, as the weight.
    qkv = shard_rule(p + "self_attn.qkv_proj.weight_scale", shape, (q + 2 * kv, 1))
    assert qkv == shard_rule(p + "self_attn.qkv_proj.weight", shape, (q + 2 * kv, hidden)) == (0, (q, kv, kv))
    gate_up = shard_rule(p + "mlp.gate_up_proj.weight_scale", shape, (2 * inter, 1))
    assert gate_up == (0, (inter, inter))


def assert_fp8_equal(got, want, where: str) -> None:
    assert isinstance(got, Fp8Weight) and isinstance(want, Fp8Weight), where
    assert got.weight.dtype == want.weight.dtype == torch.float8_e4m3fn, where
    assert got.weight.view(torch.uint8).equal(want.weight.view(torch.uint8)), where
    assert got.scale.equal(want.scale), where
    assert (got.input_scale is None and want.input_scale is None) or got.input_scale.equal(want.input_scale), where


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_reads_its_fp8_slices(checkpoints, kind, monkeypatch):
    directory = checkpoints[kind]
    full = load_model(directory, CPU, torch.float32)
    shape = full.shape
    reads = []
    close = SafetensorsSource.close

    def record(self):
        reads.append(self.bytes_read)
        close(self)

    monkeypatch.setattr(SafetensorsSource, "close", record)
    shards = [load_target_shard(directory, rank, WORLD, CPU, torch.float32, None).weights for rank in range(WORLD)]
    D = shape.head_dim
    q, kv, inter = shape.num_heads * D, shape.num_kv_heads * D, shape.intermediate_size
    for i, layer in enumerate(full.weights.layers):
        for rank, shard in enumerate(shards):
            cut = shard_weights(shape, full.weights, rank, WORLD).layers[i]
            for field in ("qkv", "o", "gate_up", "down"):
                assert_fp8_equal(getattr(shard.layers[i], field), getattr(cut, field), f"{kind} {i} {rank} {field}")
        # Column-parallel: each rank's q, k, v (gate, up) rows with their scales; concatenated per part
        # over the ranks they are the single-rank tensors, bytes and scales exactly.
        for field, sections in (("qkv", [q, kv, kv]), ("gate_up", [inter, inter])):
            whole = getattr(layer, field)
            local = [s // WORLD for s in sections]
            for tensor in ("weight", "scale"):
                ranks = [getattr(getattr(s.layers[i], field), tensor).split(local) for s in shards]
                joined = [torch.cat([r[j] for r in ranks]) for j in range(len(sections))]
                want = getattr(whole, tensor).split(sections)
                for got, expected in zip(joined, want, strict=True):
                    assert got.view(torch.uint8).equal(expected.view(torch.uint8)), (kind, i, field, tensor)
        # Row-parallel: each rank's columns, concatenated, are the weight; every rank has the whole scale.
        for field in ("o", "down"):
            whole = getattr(layer, field)
            ranks = [getattr(s.layers[i], field) for s in shards]
            joined = torch.cat([r.weight for r in ranks], 1)
            assert joined.view(torch.uint8).equal(whole.weight.view(torch.uint8)), (kind, i, field)
            assert all(r.scale.equal(whole.scale) for r in ranks), (kind, i, field)
    # Bytes: every rank reads the replicated tensors whole and half of each projection's weight and of
    # each column-parallel per-channel scale (fbgemm's input_scale_ub is never read).
    state = load_file(str(pathlib.Path(directory) / "model.safetensors"))
    replicated = sliced = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        module, field = name.split(".")[-2:]
        if field == "input_scale_ub":
            continue
        split = field == "weight" and module.endswith("proj")
        split |= field == "weight_scale" and module in COLUMN_PARALLEL and t.numel() > 1
        if split:
            sliced += nbytes
        else:
            replicated += nbytes
    assert reads == [replicated + sliced // WORLD] * WORLD


# Two ranks over gloo ------------------------------------------------------------------------------

BLOCK_SIZE = 4
PROMPT = [5, 17, 40, 8, 9, 60, 33, 12, 70, 4]
DECODE_STEPS = 8


def run_greedy(model_dir: str, group) -> dict:
    """Prefill PROMPT, then greedy paged decode steps: every step's logits and the tokens. Rank
    `group.rank` of `group.world` loads its shard as the serving ranks do (load_target_shard)."""
    from verifypd.model.kv_pool import KvPool, PoolGeometry
    from verifypd.model.layout import TokenRun
    from verifypd.model.llama import PagedLlama
    from verifypd.model.runner import ModelRunner
    from verifypd.model.tensor_parallel import shard_shape

    loaded = load_target_shard(model_dir, group.rank, group.world, CPU, torch.float32, None)
    model = PagedLlama(shard_shape(loaded.shape, group.world), loaded.weights, attention="reference")
    if group.world > 1:
        model.tp_group = group
    s = model.shape
    geometry = PoolGeometry(s.num_layers, 8, BLOCK_SIZE, s.num_kv_heads, s.head_dim)
    runner = ModelRunner(model, KvPool("target", geometry, torch.float32, CPU), graphs=False)
    blocks = tuple(range(8))
    logits = [runner.forward([TokenRun(PROMPT, 0, blocks)], "all")[-1:]]
    tokens = [int(logits[0].argmax())]
    for step in range(DECODE_STEPS):
        logits.append(runner.last_logits([TokenRun([tokens[-1]], len(PROMPT) + step, blocks)]))
        tokens.append(int(logits[-1].argmax()))
    return dict(logits=torch.cat(logits), tokens=tokens)


def as_ranks_compute(x, w, bias=None):
    """model.fp8.linear, with each row-parallel projection (o and down: the fp8 ones whose output is
    the hidden size) computed as WORLD ranks do: each rank quantizes its slice of the input columns
    by that slice's own per-token amax (a static input scale is one value for every slice), and the
    partial products are summed (the all-reduce). Per-channel weight scales apply to every partial."""
    from verifypd.model.fp8 import fp8_linear, linear

    if not isinstance(w, Fp8Weight) or w.weight.shape[0] != HIDDEN:
        return linear(x, w, bias)
    k = w.weight.shape[1] // WORLD
    parts = [
        fp8_linear(
            x[..., r * k : (r + 1) * k],
            Fp8Weight(w.weight[:, r * k : (r + 1) * k].contiguous(), w.scale, w.input_scale),
        )
        for r in range(WORLD)
    ]
    return parts[0] + parts[1] if bias is None else parts[0] + parts[1] + bias


@pytest.mark.slow  # tensor-parallel ranks as processes (gloo) (tests/README.md)
def test_fp8_tp2_over_gloo_equals_tp1(checkpoints, tmp_path, monkeypatch):
    """Static activation scales ("FP8"): TP=2 is the single-rank product up to float32 summation order.
    Dynamic ones: a row-parallel rank scales its slice of each token by that slice's amax, so TP=2 is
    the single-rank model computed that way (as_ranks_compute), and 1.7% of the logits' norm from the
    plain single-rank model here (fp8 rounding of activations), with the same greedy tokens."""
    from verifypd.model.tensor_parallel import SingleRank

    dirs = [checkpoints[kind] for kind in KINDS]
    ranks = run_on_ranks(run_greedy, dirs, tmp_path, WORLD)
    for kind, model_dir in zip(KINDS, dirs, strict=True):
        single = run_greedy(model_dir, SingleRank())
        with monkeypatch.context() as m:
            m.setattr("verifypd.model.llama.linear", as_ranks_compute)
            sliced = run_greedy(model_dir, SingleRank())
        for rank, result in enumerate(r[model_dir] for r in ranks):
            where = f"{kind} rank {rank}"
            torch.testing.assert_close(result["logits"], sliced["logits"], rtol=1e-5, atol=1e-5, msg=where)
            err = ((result["logits"] - single["logits"]).norm() / single["logits"].norm()).item()
            assert err < (1e-5 if kind == "ct-tensor" else 0.05), where
            assert result["tokens"] == single["tokens"], where
