"""Loading models: Llama-family and Gemma checkpoints (local dir, Hugging Face cache name, GGUF file, the
embedded SmolLM2) or random weights with a real model's shape (benchmarks).

Config, tokenizer and chat template come from transformers; the weights are read tensor by tensor
(model.checkpoint: safetensors memory-mapped, each tensor converted once on its device; a
tensor-parallel rank reads only its slices) and re-laid out for `PagedLlama` (fused qkv and gate/up
projections) by model.families. Only GGUF goes through a transformers model on the host.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from verifypd.domain.models import EMBEDDED_NAME, ModelLoadError, embedded_model_path
from verifypd.domain.options import QUANTIZATIONS
from verifypd.model.checkpoint import SafetensorsSource, StateDictSource, read_torch_bin, resolve_checkpoint_dir
from verifypd.model.families import ShardRule, TensorSource, shape_from_config, shard_rule, weights_from_source
from verifypd.model.fp8_load import checkpoint_quantization, quantize_layer
from verifypd.model.llama import LayerWeights, LlamaShape, LlamaWeights, unit_norms
from verifypd.model.safetensors_file import INDEX_FILE, SINGLE_FILE, checkpoint_files

BIN_FILE = "pytorch_model.bin"

# LlamaShape fields (mixed types, so Any), plus `tied` in RANDOM_SHAPES.
ShapeFields = dict[str, Any]
GEMMA: ShapeFields = dict(mlp_activation="gelu_tanh", embed_scale=True, norm_offset=1.0, tied=True, rms_norm_eps=1e-6)
QWEN2: ShapeFields = dict(qkv_bias=True, rms_norm_eps=1e-6, rope_theta=1e6)
LLAMA3: ShapeFields = dict(vocab_size=128256, rope_theta=500000.0)

# Real model shapes for GPU benchmarks with random weights (ARCHITECTURE.md). Any LlamaShape field may
# be given; unset: vocab 32000, head_dim hidden / heads, Llama's eps and theta. `tied`: lm_head = embed.
RANDOM_SHAPES: dict[str, ShapeFields] = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32),
    "codellama-34b": dict(hidden_size=8192, intermediate_size=22016, num_layers=48, num_heads=64, num_kv_heads=8),
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
    # Llama 3 (not 3.1: no llama3 rope scaling): the 128k vocabulary and rope theta 500000.
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, **LLAMA3
    ),
    "llama-3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, **LLAMA3
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        vocab_size=151936,
        **QWEN2,
    ),
    "qwen2-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        vocab_size=152064,
        **QWEN2,
    ),
    "gemma-2b": dict(
        hidden_size=2048,
        intermediate_size=16384,
        num_layers=18,
        num_heads=8,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=256000,
        **GEMMA,
    ),
    "gemma-7b": dict(
        hidden_size=3072,
        intermediate_size=24576,
        num_layers=28,
        num_heads=16,
        num_kv_heads=16,
        head_dim=256,
        vocab_size=256000,
        **GEMMA,
    ),
    # Families with per-layer features (families.py): their Hugging Face configs' values.
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        **LLAMA3,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        qk_norm=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    ),
    "gemma-2-9b": dict(
        hidden_size=3584,
        intermediate_size=14336,
        num_layers=42,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        vocab_size=256000,
        sandwich_norms=True,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=4096,
        sliding_layers=tuple(range(0, 42, 2)),
        **GEMMA,
    ),
    "phi-3-mini": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        vocab_size=32064,
        sliding_window=2047,
        sliding_layers=tuple(range(32)),
    ),
}


@dataclass
class LoadedModel:
    name: str
    shape: LlamaShape
    weights: LlamaWeights
    tokenizer: object | None  # a transformers tokenizer, or None for random-weight models
    eos_token_ids: tuple[int, ...]


@dataclass
class Checkpoint:
    """A model found and its config read: what `load_weights` needs; no weight read yet."""

    spec: str
    config: Any  # the transformers config
    shape: LlamaShape
    source: str  # what transformers' from_pretrained takes (a directory)
    kwargs: dict  # from_pretrained's extra arguments (gguf_file)
    directory: pathlib.Path | None  # a checkpoint directory (None: GGUF)
    quantization: str | None = None  # a published FP8 checkpoint's method (model.fp8_load), None: plain


def open_checkpoint(spec: str, max_context: int | None = None) -> Checkpoint:
    """Finds `spec` (a checkpoint directory, a name already in the Hugging Face cache, a .gguf file,
    the embedded model) and reads its config; an unsupported family fails here, before any weights."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantizer's own progress bar

    kwargs: dict = {}
    directory = None
    if spec == EMBEDDED_NAME:
        path = embedded_model_path()
        source, kwargs["gguf_file"] = str(path.parent), path.name
    elif spec.endswith(".gguf"):
        path = pathlib.Path(spec)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}")
        source, kwargs["gguf_file"] = str(path.parent), path.name
    else:  # a directory, or a name already in the Hugging Face cache (its snapshot); nothing is downloaded
        directory = resolve_checkpoint_dir(spec)
        source = str(directory) if directory is not None else spec
    try:
        if directory is None and "gguf_file" not in kwargs:
            raise OSError(f"{spec!r} is neither a directory nor a name in the Hugging Face cache")
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load model {spec!r}: give a local directory with config.json, a .gguf "
            f"file, a name already in the Hugging Face cache, or {EMBEDDED_NAME!r} ({exc})"
        ) from exc
    try:
        shape = shape_from_config(config, max_context)
        quantization = checkpoint_quantization(config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"model {spec!r}: {exc}") from None
    return Checkpoint(spec, config, shape, source, kwargs, directory, quantization)


def load_weights(
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    rank: int = 0,
    world: int = 1,
    quantization: str | None = None,
) -> LoadedModel:
    """The checkpoint's weights on `device` in `dtype`; with world > 1, rank `rank`'s slices only
    (model.families.shard_rule), read as slices: no rank reads or holds the whole model.
    `quantization` "fp8": the dense projections quantized per output channel as each is read, on
    the device (model.fp8_load); a published FP8 checkpoint's projections are fp8 either way, and
    under tensor parallelism their scales are cut with their rows (families.fp8_scale_rule)."""
    from transformers import AutoTokenizer

    shape = checkpoint.shape
    check_quantization(quantization)

    def rule(name: str, stored: tuple[int, ...]) -> ShardRule:
        return shard_rule(name, shape, stored) if world > 1 else None

    source = weight_source(checkpoint, device, dtype, rule, rank, world)
    try:
        tied = bool(getattr(checkpoint.config, "tie_word_embeddings", False))
        published = checkpoint.quantization is not None
        weights = weights_from_source(source, shape, tied, quantize=quantization == "fp8", published_fp8=published)
    finally:
        if isinstance(source, SafetensorsSource):
            source.close()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.source, **checkpoint.kwargs)
    config = checkpoint.config
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return LoadedModel(checkpoint.spec, shape, weights, tokenizer, eos_ids)


def weight_source(checkpoint: Checkpoint, device, dtype, rule, rank: int, world: int) -> TensorSource:
    """safetensors (memory-mapped, sliced per rank), else pytorch_model.bin (read safely), else GGUF
    through transformers (the embedded model: small, dequantized on the host)."""
    directory = checkpoint.directory
    if directory is None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(checkpoint.source, dtype=torch.float32, **checkpoint.kwargs)
        return StateDictSource(hf.state_dict(), device, dtype, rule, rank, world)
    if checkpoint_files(directory) is not None:
        return SafetensorsSource(directory, device, dtype, rule, rank, world)
    bins = torch_bin_files(directory)
    if bins:
        state: dict[str, torch.Tensor] = {}
        for path in bins:
            state.update(read_torch_bin(path))
        return StateDictSource(state, device, dtype, rule, rank, world)
    raise ModelLoadError(
        f"model {checkpoint.spec!r}: {directory} has no weights ({SINGLE_FILE}, {INDEX_FILE} or {BIN_FILE})"
    )


def torch_bin_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """pytorch_model.bin, or the shards its index names (each must exist)."""
    index = directory / (BIN_FILE + ".index.json")
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"checkpoint index {index}: field 'weight_map' unreadable ({exc})") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"checkpoint index {index}: field 'weight_map' names shard {missing[0]!r}, which is missing"
            )
        return [directory / n for n in names]
    return [directory / BIN_FILE] if (directory / BIN_FILE).is_file() else []


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    if spec.startswith("random:"):
        return random_model(spec.removeprefix("random:"), device, dtype, max_context, quantization=quantization)
    return load_weights(open_checkpoint(spec, max_context), device, dtype, quantization=quantization)


def target_shape(spec: str, max_context: int | None) -> LlamaShape:
    """The shape `load_model(spec, ...)` would give, from the config alone (no weights)."""
    if spec.startswith("random:"):
        return random_shape(spec.removeprefix("random:"), max_context)[0]
    return open_checkpoint(spec, max_context).shape


def check_quantization(quantization: str | None) -> None:
    if quantization not in (None, *QUANTIZATIONS):
        raise ModelLoadError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def random_shape(name: str, max_context: int | None) -> tuple[LlamaShape, bool]:
    """(shape, tied embeddings) of a `random:` model name."""
    if name not in RANDOM_SHAPES:
        raise ModelLoadError(f"unknown random shape {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    dims = dict(RANDOM_SHAPES[name])
    tied = dims.pop("tied", False)
    defaults = dict(
        vocab_size=32000, head_dim=dims["hidden_size"] // dims["num_heads"], rms_norm_eps=1e-5, rope_theta=10000.0
    )
    return LlamaShape(**{**defaults, **dims}, max_context=max_context or 4096), tied


def random_model(
    name: str, device, dtype, max_context: int | None, seed: int = 0, quantization: str | None = None
) -> LoadedModel:
    """Random weights with a real model's shape (no tokenizer). Scaled so activations stay finite.
    `quantization` "fp8": each layer's projections quantized as the layer is made."""
    check_quantization(quantization)
    shape, tied = random_shape(name, max_context)
    quantize = quantize_layer if quantization == "fp8" else (lambda lw: lw)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * size[-1] ** -0.5).to(dtype)

    H, inter, D = shape.hidden_size, shape.intermediate_size, shape.head_dim
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * D
    ones = torch.ones(H, device=device, dtype=dtype)
    layers = [
        quantize(
            LayerWeights(
                qkv=rand(qkv_rows, H),
                qkv_bias=rand(qkv_rows) if shape.qkv_bias else None,
                o=rand(H, shape.num_heads * D),
                gate_up=rand(2 * inter, H),
                down=rand(H, inter),
                input_norm=ones,
                post_norm=ones,
                **unit_norms(shape, device, dtype),
            )
        )
        for _ in range(shape.num_layers)
    ]
    embed = rand(shape.vocab_size, H)
    head = embed if tied else rand(shape.vocab_size, H)
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=ones, lm_head=head)
    return LoadedModel(f"random:{name}", shape, weights, None, ())
