"""The fp8 linear (model.fp8): per-channel weight quantization within e4m3's rounding bound, the
forward equal to its dequantized reference (per-token activation quantization spelled out in float32),
static input scales, the unaligned fallback, and `--quantization fp8` on load: the projections fp8,
everything else in the model dtype, logits close to the model's own."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from engine_helpers import write_tiny_llama

from verifypd.model.fp8 import FP8, FP8_MAX, WARNED, Fp8Weight, linear, quantize_weight
from verifypd.model.llama import LayerWeights, PagedLlama
from verifypd.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


def dequantized_tokens(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the forward multiplies: each row of x rounded to fp8 by its own amax (or by `scale`)."""
    s = (x.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX) if scale is None else scale
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def test_quantize_weight_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen) * torch.logspace(-3, 2, 48)[:, None]  # rows of very different range
    q = quantize_weight(w)
    assert q.weight.dtype == FP8 and q.scale.shape == (48,) and q.scale.dtype == torch.float32
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; a subnormal by
    # half the smallest step (2^-10), in units of the row's scale.
    bound = w.abs() / 16 + q.scale[:, None] * 2**-10
    assert ((q.dequantize(torch.float32) - w).abs() <= bound * 1.0001).all()
    assert torch.allclose(q.weight.float().abs().amax(1), torch.full((48,), FP8_MAX))  # each row uses the range


def test_fp8_linear_equals_its_dequantized_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=gen) * torch.logspace(-2, 2, 5)[:, None]  # tokens of different scale
    w = torch.randn(32, 64, generator=gen)
    bias = torch.randn(32, generator=gen)
    q = quantize_weight(w)
    y = linear(x, q, bias)
    ref = torch.nn.functional.linear(dequantized_tokens(x.reshape(-1, 64)), q.dequantize(torch.float32), bias)
    assert y.shape == (2, 5, 32) and y.dtype == x.dtype
    torch.testing.assert_close(y.reshape(-1, 32), ref, rtol=1e-5, atol=1e-5)
    exact = torch.nn.functional.linear(x, w, bias)  # and close to the unquantized product
    assert ((y - exact).norm() / exact.norm()).item() < 0.05
    assert linear(x, w, bias).equal(exact)  # a plain tensor is plain F.linear


def test_static_input_scale_quantizes_by_it():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 32, generator=gen)
    q = quantize_weight(torch.randn(16, 32, generator=gen))
    scale = torch.tensor(0.5 / FP8_MAX)  # calibrated for |x| <= 0.5: larger values clip
    static = Fp8Weight(q.weight, q.scale, scale)
    ref = torch.nn.functional.linear(dequantized_tokens(x, scale), q.dequantize(torch.float32))
    torch.testing.assert_close(linear(x, static), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(linear(x, static), linear(x, q), rtol=1e-2)  # not the dynamic path


def test_zero_tokens_and_rows_stay_finite():
    w = torch.randn(16, 32)
    w[3] = 0
    q = quantize_weight(w)
    x = torch.randn(4, 32)
    x[1] = 0
    y = linear(x, q)
    assert torch.isfinite(y).all() and (y[1] == 0).all() and (y[:, 3] == 0).all()
    assert linear(x[:0], q).shape == (0, 16)


def test_unaligned_shape_falls_back_with_one_warning():
    q = quantize_weight(torch.randn(24, 40))  # neither dim a multiple of 16
    x = torch.randn(3, 40)
    WARNED.discard((24, 40))
    with pytest.warns(UserWarning, match=r"fp8 linear \[24, 40\].*dequantized"):
        y = linear(x, q)
    torch.testing.assert_close(y, x @ q.dequantize(torch.float32).t())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call does not warn again
        linear(x, q)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("fp8") / "llama", seed=3, layers=2))


def logits(model: PagedLlama, tokens: list[int]) -> torch.Tensor:
    from verifypd.model.layout import TokenRun, build_layout
    from verifypd.model.llama import BatchLayout

    s, block = model.shape, 4
    pool = torch.zeros(2, s.num_layers, 8, block, s.num_kv_heads, s.head_dim)
    lay = build_layout([TokenRun(tokens, 0, (3, 0, 6, 1, 5))], block)
    t = torch.tensor
    batch = BatchLayout(
        t(lay.ids),
        t(lay.positions),
        t(lay.slots),
        t(lay.tables, dtype=torch.int32),
        t(lay.query_start, dtype=torch.int32),
        lay.max_query,
    )
    return model.forward(pool, batch, torch.arange(len(tokens)))


PROMPT = [5, 17, 40, 8, 9, 60, 33, 12, 70, 4, 4, 81]


def reference_linear(x, w, bias=None):
    """model.fp8.linear spelled out in float32: fp8-rounded tokens times the dequantized weight."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, bias)
    return torch.nn.functional.linear(dequantized_tokens(x, w.input_scale), w.dequantize(x.dtype), bias)


def test_quantization_fp8_on_load(tiny, monkeypatch):
    plain = load_model(tiny, CPU, torch.float32)
    fp8 = load_model(tiny, CPU, torch.float32, quantization="fp8")
    for lw, ref in zip(fp8.weights.layers, plain.weights.layers, strict=True):
        assert isinstance(lw, LayerWeights)
        for field in ("qkv", "o", "gate_up", "down"):
            w, r = getattr(lw, field), getattr(ref, field)
            assert isinstance(w, Fp8Weight) and w.weight.dtype == FP8 and w.shape == r.shape
            assert w.weight.equal(quantize_weight(r).weight)  # per output channel, as quantize_weight
        assert lw.input_norm.dtype == torch.float32
    # Embeddings, final norm and lm_head stay in the model dtype.
    for t in (fp8.weights.embed, fp8.weights.lm_head, fp8.weights.final_norm):
        assert t.dtype == torch.float32
    model = PagedLlama(fp8.shape, fp8.weights)
    got = logits(model, PROMPT)
    full = logits(PagedLlama(plain.shape, plain.weights), PROMPT)
    assert ((got - full).norm() / full.norm()).item() < 0.08  # measured 0.047
    assert (got.argmax(-1) == full.argmax(-1)).float().mean().item() >= 0.9
    # Every projection of the forward goes through the fp8 product with its own scales: the same
    # forward over the float32 spelling of it agrees to float32 rounding.
    monkeypatch.setattr("verifypd.model.llama.linear", reference_linear)
    ref = logits(model, PROMPT)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_unknown_quantization_is_refused(tiny):
    with pytest.raises(ModelLoadError, match=r"--quantization must be one of fp8, got 'int4'"):
        load_model(tiny, CPU, torch.float32, quantization="int4")


def test_random_model_quantizes_each_layer(monkeypatch):
    from verifypd.model.loader import RANDOM_SHAPES
    from verifypd.model.tensor_parallel import shard_weights

    dims = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=128)
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-fp8", dims)
    loaded = load_model("random:tiny-fp8", CPU, torch.bfloat16, 64, quantization="fp8")
    plain = load_model("random:tiny-fp8", CPU, torch.bfloat16, 64)
    for lw, ref in zip(loaded.weights.layers, plain.weights.layers, strict=True):
        assert isinstance(lw.gate_up, Fp8Weight) and lw.gate_up.weight.equal(quantize_weight(ref.gate_up).weight)
    assert loaded.weights.lm_head.dtype == torch.bfloat16
    # A tensor-parallel rank's shard of fp8 weights: its rows keep their scales, its columns the row's.
    shard = shard_weights(loaded.shape, loaded.weights, 1, 2).layers[0]
    full = loaded.weights.layers[0]
    assert isinstance(shard.down, Fp8Weight) and isinstance(full.down, Fp8Weight)
    assert shard.down.weight.view(torch.uint8).equal(full.down.weight[:, 48:].view(torch.uint8))
    assert shard.down.scale.equal(full.down.scale)
    assert isinstance(shard.gate_up, Fp8Weight) and isinstance(full.gate_up, Fp8Weight)
    assert shard.gate_up.scale.equal(torch.cat([full.gate_up.scale[48:96], full.gate_up.scale[144:]]))


@pytest.mark.parametrize("draft", ["ngram", "self:1", "model"])
def test_speculation_on_an_fp8_target_is_lossless(tiny_models, draft):
    """Greedy speculation (prompt lookup, the fp8 target's own first layer, a draft model) returns the
    fp8 target's own plain decoding, token for token."""
    from engine_helpers import make_engine

    from verifypd.domain.requests import RequestSpec

    target = tiny_models[0]
    prompts = [(5, 6, 7, 5, 6, 7, 5, 6), (40, 41, 9), (12, 13, 14, 15, 12, 13), (88,)]

    def run(draft: str, k: int):
        engine = make_engine(target, draft, k=k, quantization="fp8")
        assert isinstance(engine.models.target.weights.layers[0].qkv, Fp8Weight)
        done = engine.generate([RequestSpec(p, max_tokens=20, stop_at_eos=False) for p in prompts])
        return list(done.values())

    plain = [c.token_ids for c in run("none", 0)]
    spec = run(tiny_models[1] if draft == "model" else draft, 4)
    assert [c.token_ids for c in spec] == plain
    assert sum(c.usage["accepted_tokens"] for c in spec) > 0  # speculation did run


needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_kernel_equals_the_torch_reference(dtype):
    """model.kernels.fp8_quant (the CUDA path's one launch) against quantize_tokens / quantize_static:
    the same scales and the same fp8 values, ties to even at every grid midpoint included (equal as
    numbers: the interpreter writes -0 as +0)."""
    from verifypd.model.fp8 import MIN_AMAX, quantize_static, quantize_tokens
    from verifypd.model.kernels.fp8_quant import quantize_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 1000, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[2], x[3, :50] = 0, 1e-30
    x = x.to(device=device, dtype=dtype)
    q, s = quantize_rows(x, None, FP8_MAX, MIN_AMAX)
    want_q, want_s = quantize_tokens(x)
    assert s.equal(want_s) and q.float().equal(want_q.float())
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # each halfway between two fp8 values: rounds to the even one
    y = torch.cat([grid, mids, mids * 1.0000001, mids * 0.9999999, torch.tensor([500.0, -1e4])])[None].to(device)
    one = torch.tensor(1.0, device=device)
    q, s = quantize_rows(y, one, FP8_MAX, MIN_AMAX)
    want_q, want_s = quantize_static(y, one)
    assert s.equal(want_s) and q.float().equal(want_q.float())
