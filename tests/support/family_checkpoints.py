"""Tiny random checkpoints of each supported family, written with transformers' own config and model
classes, with the family's features switched on and made to matter: windows shorter than the
prompts, soft caps that clip, RoPE scaling, q/k norms and (1 + w) norms with random weights."""

from __future__ import annotations

import pathlib

import torch
from engine_helpers import VOCAB, write_tokenizer

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=64**-0.5,
)
WINDOW = 5  # shorter than most prompts: the sliding layers' window matters
LONGROPE_CONTEXT = 64  # Phi-3's original context (max_position_embeddings 256: an attention factor != 1)


def family_config(family: str):
    """The transformers config of the tiny `family` checkpoint (a key of FAMILIES)."""
    import transformers as tf

    gemma = dict(hidden_activation="gelu_pytorch_tanh", head_dim=32, query_pre_attn_scalar=24, rms_norm_eps=1e-6)
    sliding_types = ["sliding_attention", "full_attention", "sliding_attention"]
    if family == "llama3.2":  # llama3 RoPE scaling (its original context inside the prompts), tied head
        rope = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
            rope_theta=500000.0,
        )
        return tf.LlamaConfig(rope_parameters=rope, tie_word_embeddings=True, **COMMON)
    if family == "mistral":  # every layer slides
        return tf.MistralConfig(sliding_window=WINDOW, tie_word_embeddings=False, **COMMON)
    if family == "qwen3":  # q/k norms, head_dim 32 != hidden / heads
        return tf.Qwen3Config(head_dim=32, tie_word_embeddings=False, **COMMON)
    if family == "gemma2":
        return tf.Gemma2Config(
            sliding_window=WINDOW,
            layer_types=sliding_types,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
            **gemma,
            **COMMON,
        )
    if family == "gemma3_text":  # local layers with their own base, global layers with linear scaling
        rope = dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
        )
        return tf.Gemma3TextConfig(
            sliding_window=WINDOW,
            layer_types=sliding_types,
            rope_parameters=rope,
            attn_logit_softcapping=2.0,  # transformers' Gemma 3 ignores it (and so must we)
            final_logit_softcapping=6.0,
            tie_word_embeddings=True,
            **gemma,
            **COMMON,
        )
    if family == "phi3":  # fused qkv / gate_up in the checkpoint, longrope, a window on every layer
        gen = torch.Generator().manual_seed(9)
        half = 16 // 2  # head_dim 16
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=(1 + torch.rand(half, generator=gen)).tolist(),
            long_factor=(1 + 4 * torch.rand(half, generator=gen)).tolist(),
            original_max_position_embeddings=LONGROPE_CONTEXT,
        )
        return tf.Phi3Config(
            sliding_window=WINDOW,
            rope_parameters=rope,
            original_max_position_embeddings=LONGROPE_CONTEXT,
            tie_word_embeddings=False,
            **COMMON,
        )
    raise ValueError(family)


FAMILIES = ("llama3.2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3")


def write_family(path: pathlib.Path, family: str, seed: int = 0) -> pathlib.Path:
    """A tiny random `family` checkpoint + tokenizer in `path`. Weights are shaped so that greedy
    choices are well separated and varied: random norm weights (around 1, or around 0 for the
    (1 + w) norms of Gemma), sublayer outputs x4, and a sharp final norm (the head may be tied)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family)
    model = AutoModelForCausalLM.from_config(config)
    offset = 0.0 if family.startswith("gemma") else 1.0  # Gemma norms: (1 + w)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(offset + 0.5 * torch.randn(param.shape))
        model.model.norm.weight.add_(6.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(4.0)
            layer.mlp.down_proj.weight.mul_(4.0)
            if hasattr(layer, "post_feedforward_layernorm"):  # Gemma 2/3 norm the sublayer outputs: the
                # scale is the norm's weight (else the tied head mostly sees the token's own embedding)
                layer.post_attention_layernorm.weight.add_(6.0)
                layer.post_feedforward_layernorm.weight.add_(6.0)
    model.save_pretrained(path)
    write_tokenizer(path, VOCAB)
    return path


MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)


def write_tiny_moe(path: pathlib.Path, family: str, tokenizer_from: pathlib.Path, seed: int) -> pathlib.Path:
    """Mixtral: 4 experts of intermediate 48. Qwen3-MoE: 8 experts of 24, qk-norm, head_dim 32 (not
    hidden / heads), layer 1 dense (mlp_only_layers), top-k weights not renormalised."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **MOE_COMMON))
    else:
        config = Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=24,
            num_experts=8,
            head_dim=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **MOE_COMMON,
        )
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):  # the router (Qwen3-MoE's starts at zero): distinct choices
                param.normal_(0, 1.0)
            elif "experts" in name:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
        model.lm_head.weight.mul_(8.0)  # greedy choices well separated (no float near-ties)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


def hf_greedy_through_eos(hf, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy `generate` that neither stops at nor suppresses EOS (the engine's
    stop_at_eos=False: EOS is an ordinary token)."""
    from transformers import GenerationConfig

    hf.generation_config.eos_token_id = None  # else merged back into the config below
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()
