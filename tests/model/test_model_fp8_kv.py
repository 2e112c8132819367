"""The fp8 KV cache (`--kv-cache-dtype fp8`, model.kv_quant): the write kernel stores what the torch
reference quantizes (scaled, saturated), the attention kernel reads fp8 caches as their dequantized
values (non-unit scales, NaN garbage in unseen slots), pools are sized by the element size, greedy
speculation stays lossless with respect to the fp8-KV target on both backends, and a device that
can't gets a one-line error naming the flag. Triton runs under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import DEVICE, make_engine
from test_model_greedy_lossless import random_prompts
from test_model_paged_attention import CASES, make_case, reference

from verifypd.domain.models import ModelLoadError
from verifypd.domain.options import EngineOptions
from verifypd.domain.requests import RequestSpec
from verifypd.model import kv_quant
from verifypd.model.fp8 import FP8, FP8_MAX
from verifypd.model.kv_pool import PoolGeometry, blocks_that_fit
from verifypd.model.rope import apply_rope

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)


def test_quantize_saturates_and_round_trips_within_e4m3():
    x = torch.tensor([0.0, 1.0, -3.3, 100.0, 1000.0, -5000.0, 0.004])
    q = kv_quant.quantize(x, 2.0)
    assert q.dtype == FP8
    back = kv_quant.dequantize(q, torch.float32, 2.0)
    assert back[4] == 2 * FP8_MAX and back[5] == -2 * FP8_MAX  # saturated, not NaN
    inside = x.abs() <= 2 * FP8_MAX
    # 3 mantissa bits: within 2^-4 of the value, or half the smallest subnormal step (2^-10) times the scale.
    assert ((back - x).abs()[inside] <= x.abs()[inside] / 16 + 2 * 2**-10).all()


def test_reference_store_quantizes_and_saturates():
    """The CPU path's write: fp8 caches get kv_quant.quantize (saturating), not a plain cast (NaN past 448)."""
    from verifypd.model.reference_attention import store_kv_reference

    k = torch.tensor([[[1.0, -600.0]], [[3.3, 1e5]]])  # [T, kvh, D]
    v = -k
    k_cache, v_cache = torch.zeros(4, 1, 2, dtype=FP8), torch.zeros(4, 1, 2, dtype=FP8)
    store_kv_reference(k, v, k_cache, v_cache, torch.tensor([2, -1]))
    assert k_cache[2].float().tolist() == [[1.0, -FP8_MAX]] and v_cache[2].float().tolist() == [[-1.0, FP8_MAX]]
    assert (k_cache[[0, 1, 3]].float() == 0).all()  # slot -1: nowhere


@needs_triton
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 4.0)])
def test_rope_kv_writes_the_quantized_reference(k_scale, v_scale):
    from verifypd.model.kernels.rope_kv import rope_and_store_kv

    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, d = 6, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 30  # some values past 448 * scale
    qkv[0, heads * d] = 1e4  # a key far past the range: saturates
    positions = torch.tensor([0, 1, 2, 7, 8, 9])
    slots = torch.tensor([3, 4, -1, 10, 11, 0])  # -1: written nowhere
    theta = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(16).float()[:, None] * theta[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    k_cache = torch.zeros(16, kv_heads, d, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    q = rope_and_store_kv(
        to(qkv), to(cos), to(sin), to(positions), to(slots), k_cache, v_cache, heads, k_scale=k_scale, v_scale=v_scale
    )
    c, s = cos[positions][:, None], sin[positions][:, None]
    k = apply_rope(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d), c, s)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    torch.testing.assert_close(q.cpu(), apply_rope(qkv[:, : heads * d].view(tokens, heads, d), c, s))
    keep = slots >= 0
    want_k = kv_quant.dequantize(kv_quant.quantize(k[keep], k_scale), torch.float32, k_scale)
    want_v = kv_quant.dequantize(kv_quant.quantize(v[keep], v_scale), torch.float32, v_scale)
    got_k = kv_quant.dequantize(k_cache.cpu()[slots[keep]], torch.float32, k_scale)
    got_v = kv_quant.dequantize(v_cache.cpu()[slots[keep]], torch.float32, v_scale)
    assert torch.equal(got_v, want_v)  # v is copied: bit for bit
    # k: the kernel's rotation may differ from torch's in the last float32 bit, which can move a value
    # across an fp8 rounding boundary: one e4m3 step (1/8 of the value) at most, and rarely.
    step = want_k.abs() / 8 + k_scale * 2**-9
    assert ((got_k - want_k).abs() <= step).all()
    assert (got_k == want_k).float().mean() > 0.98
    assert got_k[0, 0].abs().max() == FP8_MAX * k_scale  # the huge key saturated
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    unwritten = torch.ones(16, dtype=torch.bool)
    unwritten[slots[keep]] = False
    assert (k_cache.cpu()[unwritten].float() == 0).all()


@needs_triton
@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_paged_attention_reads_fp8_as_its_dequantized_values(kind, q_dtype):
    from verifypd.model.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        CASES[kind], heads=8, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, gen=gen
    )
    k_scale, v_scale = 0.05, 3.0
    kc8, vc8 = kv_quant.quantize(kc * 20, k_scale), kv_quant.quantize(vc, v_scale)  # NaN garbage stays NaN
    out = paged_attention(q.to(q_dtype), kc8, vc8, tables, pos, qs, max_q, 32**-0.5, k_scale=k_scale, v_scale=v_scale)
    deq_k = kv_quant.dequantize(kc8.cpu(), torch.float64, k_scale)
    deq_v = kv_quant.dequantize(vc8.cpu(), torch.float64, v_scale)
    ref = reference(q.to(q_dtype).cpu(), deq_k, deq_v, tables.cpu(), pos.cpu(), qs.cpu(), 32**-0.5)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < (1e-5 if q_dtype == torch.float32 else 2e-3), f"relative error {err:.2e}"
    # The scales are applied: reading the same bytes with unit scales is another answer.
    plain = paged_attention(q.to(q_dtype), kc8, vc8, tables, pos, qs, max_q, 32**-0.5)
    assert (plain.cpu().double() - ref).norm() / ref.norm() > 0.1


def test_pools_are_sized_by_the_kv_element_size():
    g = PoolGeometry(num_layers=4, num_blocks=1, block_size=16, num_kv_heads=8, head_dim=128)
    assert g.bytes_per_block(torch.bfloat16) == 2 * g.bytes_per_block(FP8)
    budget = 3 << 30
    assert blocks_that_fit(g, FP8, budget) == 2 * blocks_that_fit(g, torch.bfloat16, budget)


def test_make_pools_allocates_fp8_pools_twice_the_blocks(monkeypatch):
    """model.build.make_pools sizes from the KV dtype, not the model dtype (CPU: 1 GiB worth)."""
    from verifypd.model import build

    shape = SimpleNamespace(num_kv_heads=8, head_dim=128)
    target = SimpleNamespace(shape=shape, num_layers=16)  # 1 MiB a bf16 block of 16 tokens
    blocks = {}
    for kv in (None, FP8):
        models = SimpleNamespace(
            target_model=target,
            draft_model=None,
            dtype=torch.bfloat16,
            kv_dtype=kv,
            device=torch.device("cpu"),
            ranks=None,
        )
        pool, draft = build.make_pools(models, EngineOptions(block_size=16))
        assert draft is None and pool.tensor.dtype == (kv or torch.bfloat16)
        blocks[kv] = pool.geometry.num_blocks
        assert "blocks" in pool.summary() and f"{blocks[kv] * 16} tokens" in pool.summary()
        del pool
    assert blocks == {None: 1024, FP8: 2048}


def test_kv_cache_dtype_errors_name_the_flag(monkeypatch):
    assert kv_quant.kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_quant.kv_cache_dtype("fp8", torch.float32, torch.device("cpu")) == FP8
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype must be one of auto, fp8, got 'int4'"):
        kv_quant.kv_cache_dtype("int4", torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ModelLoadError) as err:
        kv_quant.kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    assert "--kv-cache-dtype fp8" in str(err.value) and "8.0" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kv_quant.kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda")) == FP8


def test_cli_refuses_a_bad_kv_cache_dtype(capsys):
    from verifypd.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--offline", "--kv-cache-dtype", "int4", "hi"])
    assert exit_.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


def _outputs(engine, prompts, max_tokens=16):
    done = engine.generate([RequestSpec(p, max_tokens=max_tokens, stop_at_eos=False) for p in prompts])
    return [c.token_ids for c in done.values()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_speculation_is_lossless_over_an_fp8_kv_target(tiny_models, monkeypatch, backend):
    """Greedy output with a draft equals greedy output without one, all with fp8 KV (target and draft
    pools fp8), and the fp8 pool really is in use. The interpreter is slow: the Triton case is smaller."""
    monkeypatch.setenv("VERIFYPD_ATTENTION", backend)
    triton_case = backend == "triton"
    prompts = random_prompts(2 if triton_case else 4, seed=5, max_len=20 if triton_case else 30)
    tokens = 8 if triton_case else 16
    plain = make_engine(*tiny_models, k=0, kv_cache_dtype="fp8")
    assert plain.target_pool.tensor.dtype == FP8 and plain.models.target_model.attention == backend
    expected = _outputs(plain, prompts, tokens)
    assert plain.target_pool.tensor.float().abs().sum() > 0  # K/V were written into the fp8 pool
    drafts = ((tiny_models[1], 3),) if triton_case else ((tiny_models[1], 3), ("self:1", 5))
    for draft, k in drafts:
        engine = make_engine(tiny_models[0], draft, k=k, kv_cache_dtype="fp8")
        assert engine.draft_pool is not None and engine.draft_pool.tensor.dtype == FP8
        done = engine.generate([RequestSpec(p, max_tokens=tokens, stop_at_eos=False) for p in prompts])
        assert [c.token_ids for c in done.values()] == expected, f"draft {draft}, k = {k}"
        assert sum(c.usage["draft_tokens"] for c in done.values()) > 0
    if triton_case:  # the GPU path (Triton write + attention over fp8) against the CPU path (torch)
        monkeypatch.setenv("VERIFYPD_ATTENTION", "reference")
        assert _outputs(make_engine(*tiny_models, k=0, kv_cache_dtype="fp8"), prompts, tokens) == expected


def test_fp8_kv_logits_stay_close_to_the_model_dtypes(tiny_models):
    """Same prompt, fp32 KV vs fp8 KV: the stored values differ (fp8 is in effect) and the last
    position's next-token distribution stays close (KL well under 0.01 on the tiny model)."""
    from verifypd.model.runner import ModelRunner, TokenRun

    prompt = list(random_prompts(1, seed=3, max_len=30)[0]) + [7] * 12
    logits = {}
    for kv in ("auto", "fp8"):
        engine = make_engine(*tiny_models, k=0, kv_cache_dtype=kv)
        runner = ModelRunner(engine.models.target_model, engine.target_pool, graphs=False)
        blocks = tuple(range(-(-len(prompt) // 4)))
        logits[kv] = runner.forward([TokenRun(prompt, 0, blocks)], "last").float()
    p, q = logits["auto"].log_softmax(-1), logits["fp8"].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).item()
    assert 0 < kl < 1e-2, kl


@pytest.mark.slow
def test_eagle_head_over_an_fp8_kv_target_is_lossless(tiny_models, tmp_path):
    """A feature draft: its one-layer KV pool is fp8 too, its feature pool stays in the model dtype."""
    from engine_cases import write_head

    head = write_head(tiny_models, tmp_path / "head")
    prompts = random_prompts(4, seed=9)
    expected = _outputs(make_engine(tiny_models[0], "none", k=0, kv_cache_dtype="fp8"), prompts)
    engine = make_engine(tiny_models[0], head, k=3, kv_cache_dtype="fp8")
    assert engine.draft_pool is not None and engine.draft_pool.tensor.dtype == FP8
    done = engine.generate([RequestSpec(p, max_tokens=16, stop_at_eos=False) for p in prompts])
    assert [c.token_ids for c in done.values()] == expected
    assert sum(c.usage["draft_tokens"] for c in done.values()) > 0
