"""Loading a checkpoint for serving: time to the device and host memory above baseline.

Writes a checkpoint with random weights (labelled so) of a named shape (loader.RANDOM_SHAPES, bf16,
HF-style ~5 GB shards plus model.safetensors.index.json, a config.json and a tokenizer) to --dir,
drops nothing from the page cache (it was just written: a warm cache, as a restarting server sees),
and reports:

  (a) read speed: the shard files read once with plain reads (disk or page cache, whichever holds them)
  (b) load time: verifypd's load_model to --device, in a fresh process
  (c) host memory: peak RSS above that process's baseline (taken after imports, the CUDA context, and
      one read of the config and tokenizer), against the checkpoint's size
  (d) per --tensor-parallel W: rank 0's load of its own slices (load_target_shard): the bytes it
      read, its time and host peak; plus, from the shape alone, the bytes one rank of W reads

On a GPU (the lead's command; ~16 GB written to --dir, 128 GiB host memory is plenty):

    python bench/engine/load_time.py --shape llama-3-8b --device cuda --tensor-parallel 2 \\
        --dir /tmp/llama3-8b-random --out load_time.json

On the CPU, small: python bench/engine/load_time.py --smoke --out /tmp/load_time.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench_meta
from bench_meta import metadata

SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained cuts at ("5GB")
SMOKE = dict(shape="tinyllama-1.1b", layers=2)


def tensor_list(shape, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors (transformers' Llama / Qwen2 names) for a LlamaShape."""
    H, D, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * D, shape.num_kv_heads * D
    out = [("model.embed_tokens.weight", (shape.vocab_size, H))]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out.append((f"{p}self_attn.{name}_proj.weight", (rows, H)))
            if shape.qkv_bias:
                out.append((f"{p}self_attn.{name}_proj.bias", (rows,)))
        out += [
            (f"{p}self_attn.o_proj.weight", (H, q)),
            (f"{p}mlp.gate_proj.weight", (inter, H)),
            (f"{p}mlp.up_proj.weight", (inter, H)),
            (f"{p}mlp.down_proj.weight", (H, inter)),
            (f"{p}input_layernorm.weight", (H,)),
            (f"{p}post_attention_layernorm.weight", (H,)),
        ]
    out.append(("model.norm.weight", (H,)))
    if not tied:
        out.append(("lm_head.weight", (shape.vocab_size, H)))
    return out


def named_shape(name: str, layers: int | None):
    import dataclasses

    from verifypd.model.loader import random_shape

    shape, tied = random_shape(name, 4096)
    if shape.mlp_activation != "silu":
        raise SystemExit(f"--shape {name}: only Llama / Qwen2-style shapes are written")
    return (dataclasses.replace(shape, num_layers=layers) if layers else shape), tied


def write_checkpoint(directory: pathlib.Path, shape, tied: bool, shard_bytes: int) -> int:
    """Random bf16 weights (std 0.02, norms 1) in safetensors shards; returns the weights' bytes."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    tensors = tensor_list(shape, tied)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = math.prod(dims) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    pattern = (torch.randn(1 << 23, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    raw = pattern.view(torch.uint8).numpy()
    ones = torch.ones(shape.hidden_size, dtype=torch.bfloat16).view(torch.uint8).numpy()
    weight_map, total, roll = {}, 0, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims in shard:
            nbytes = math.prod(dims) * 2
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        with open(directory / file, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for name, dims in shard:
                nbytes = math.prod(dims) * 2
                total += nbytes
                if name.endswith("norm.weight"):
                    f.write(ones)
                    continue
                while nbytes:  # the random pattern, rolled so that tensors differ
                    piece = min(nbytes, raw.size - roll)
                    f.write(raw[roll : roll + piece])
                    nbytes -= piece
                    roll = (roll + piece) % raw.size  # stays even: whole bf16 values
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    write_config_and_tokenizer(directory, shape, tied)
    return total


def write_config_and_tokenizer(directory: pathlib.Path, shape, tied: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = {
        "architectures": ["Qwen2ForCausalLM" if shape.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if shape.qkv_bias else "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_context,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, shape.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        directory
    )


def read_speed(directory: pathlib.Path) -> dict:
    """Reads every shard once with readinto (no mapping): the page cache's or the disk's speed."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - t0
    return {"bytes": total, "seconds": round(seconds, 3), "gb_per_s": round(total / seconds / 1e9, 2)}


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(directory: str, device_name: str, dtype_name: str, rank: int, world: int) -> dict:
    """One load in this (fresh) process: seconds, host RSS above baseline, bytes this rank read."""
    import torch
    from transformers import AutoTokenizer

    from verifypd.model.checkpoint import SafetensorsSource
    from verifypd.model.loader import load_model, open_checkpoint
    from verifypd.model.tensor_parallel import load_target_shard

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context belongs to the baseline
    open_checkpoint(directory)
    AutoTokenizer.from_pretrained(directory)
    reads: list[int] = []
    close = SafetensorsSource.close

    def record(self):  # the bytes this rank read (the source's counter, taken when it closes)
        reads.append(self.bytes_read)
        close(self)

    SafetensorsSource.close = record  # type: ignore[method-assign]
    baseline = rss_now()
    t0 = time.perf_counter()
    if world == 1:
        loaded = load_model(directory, device, dtype)
    else:
        loaded = load_target_shard(directory, rank, world, device, dtype, None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(t.numel() * t.element_size() for t in all_tensors(loaded.weights))
    return {
        "rank": rank,
        "world": world,
        "device": device_name,
        "dtype": dtype_name,
        "load_s": round(seconds, 3),
        "rss_baseline_bytes": baseline,
        "rss_peak_above_baseline_bytes": peak - baseline,
        "bytes_read": reads[0] if reads else None,
        "weights_bytes_on_device": held,
    }


def all_tensors(weights) -> list:
    import dataclasses

    seen: dict[int, object] = {}
    for t in [weights.embed, weights.lm_head, weights.final_norm] + [
        getattr(layer, f.name) for layer in weights.layers for f in dataclasses.fields(layer)
    ]:
        if t is not None:
            seen[id(t)] = t
    return list(seen.values())


def measure_in_child(directory: pathlib.Path, device: str, dtype: str, rank: int, world: int) -> dict:
    cmd = [sys.executable, __file__, "--measure", str(directory), "--device", device, "--dtype", dtype]
    cmd += ["--rank", str(rank), "--world", str(world)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def analytic(shape, tied: bool, worlds: list[int]) -> dict:
    """From the shape alone: the checkpoint's bytes, what one rank of W reads, the largest tensor."""
    from verifypd.model.families import shard_rule

    tensors = tensor_list(shape, tied)
    sizes = {name: math.prod(dims) * 2 for name, dims in tensors}
    total = sum(sizes.values())
    sliced = sum(sizes[name] for name, dims in tensors if shard_rule(name, shape, dims) is not None)
    return {
        "checkpoint_bytes": total,
        "largest_tensor_bytes": max(sizes.values()),
        "rank_bytes_read": {str(w): total - sliced + sliced // w for w in worlds},
        "formula": "replicated (embeddings, lm_head, norms) + sliced / W",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b", help="a loader.RANDOM_SHAPES name")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tensor-parallel", default="2", help="comma-separated W to simulate (rank 0 loads)")
    ap.add_argument("--analytic-shapes", default="llama-3-8b,llama-3-70b", help="shapes for the formula only")
    ap.add_argument("--shard-bytes", type=int, default=SHARD_BYTES)
    ap.add_argument("--smoke", action="store_true", help=f"a small checkpoint: {SMOKE}")
    ap.add_argument("--out", required=False)
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: one load, JSON on stdout
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.device, args.dtype, args.rank, args.world)))
        return
    if args.smoke:
        args.shape, args.layers = SMOKE["shape"], SMOKE["layers"]
        args.shard_bytes = min(args.shard_bytes, 200 * 10**6)  # several shards even when small
    import tempfile

    directory = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="load_time_"))
    shape, tied = named_shape(args.shape, args.layers)
    t0 = time.perf_counter()
    size = write_checkpoint(directory, shape, tied, args.shard_bytes)
    written_s = time.perf_counter() - t0
    worlds = [int(w) for w in args.tensor_parallel.split(",") if w.strip()]
    result = {
        **metadata(),
        "weights": "random (bf16, std 0.02): load cost only, the model's output is meaningless",
        "shape": args.shape,
        "layers": shape.num_layers,
        "checkpoint_dir": str(directory),
        "checkpoint_bytes": size,
        "shards": len(list(directory.glob("*.safetensors"))),
        "write_s": round(written_s, 2),
        "page_cache": "warm: the files were just written; nothing is dropped",
        "read": read_speed(directory),
    }
    full = measure_in_child(directory, args.device, args.dtype, 0, 1)
    full["rss_peak_over_checkpoint"] = round(full["rss_peak_above_baseline_bytes"] / size, 3)
    result["load"] = full
    result["tensor_parallel"] = []
    for w in worlds:
        rank = measure_in_child(directory, args.device, args.dtype, 0, w)
        rank["bytes_read_over_checkpoint"] = round(rank["bytes_read"] / size, 3)
        rank["rss_peak_over_checkpoint"] = round(rank["rss_peak_above_baseline_bytes"] / size, 3)
        result["tensor_parallel"].append(rank)
    result["analytic"] = {name: analytic(*named_shape(name, None), worlds) for name in args.analytic_shapes.split(",")}
    result["analytic"]["as written"] = analytic(shape, tied, worlds)
    print(json.dumps(result, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.dir:
        import shutil

        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
