"""Loading checkpoints for serving (model.checkpoint, model.loader): safetensors read tensor by tensor
from the file's mapping, sharded or not, in the serving dtype; a tensor-parallel rank reads only its
slices (and gets exactly model.tensor_parallel.shard_weights' shard); pytorch_model.bin read without
running code; names in the Hugging Face cache; and every broken checkpoint is a ModelLoadError naming
the file and the field, never a traceback."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import struct

import pytest
import torch
from engine_helpers import write_tiny_llama
from safetensors.torch import load_file, save_file

from verifypd.model.checkpoint import SafetensorsSource
from verifypd.model.loader import ModelLoadError, load_model, open_checkpoint
from verifypd.model.tensor_parallel import load_target_shard, shard_weights

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama", seed=3, layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def reference(tiny):
    """The weights as transformers' own model holds them (float32), through the same mapping."""
    from transformers import AutoModelForCausalLM

    from verifypd.model.checkpoint import StateDictSource
    from verifypd.model.families import weights_from_source

    shape = open_checkpoint(str(tiny)).shape
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    return shape, weights_from_source(StateDictSource(hf.state_dict(), CPU, torch.float32), shape, False)


def copy_model(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def shard_checkpoint(directory: pathlib.Path, parts: int = 3) -> None:
    """Rewrites model.safetensors as HF-style shards plus model.safetensors.index.json."""
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: state[n] for n in names[i::parts]}
        save_file(chunk, str(directory / file))
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def assert_weights_equal(a, b) -> None:
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.final_norm, b.final_norm)
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        for field in dataclasses.fields(x):
            u, v = getattr(x, field.name), getattr(y, field.name)
            assert (u is None and v is None) or torch.equal(u, v), (i, field.name)


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_checkpoint_loads_transformers_weights(tiny, reference, tmp_path, layout):
    directory = copy_model(tiny, tmp_path / layout)
    if layout == "sharded":
        shard_checkpoint(directory)
    elif layout == "bin":
        torch.save(load_file(str(directory / "model.safetensors")), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    loaded = load_model(str(directory), CPU, torch.float32)
    assert loaded.shape == reference[0] and loaded.eos_token_ids == (2,)
    assert_weights_equal(loaded.weights, reference[1])


def test_serving_dtype_converts_each_tensor_once(tiny, reference):
    loaded = load_model(str(tiny), CPU, torch.bfloat16)
    assert {t.dtype for t in (loaded.weights.embed, loaded.weights.layers[0].qkv)} == {torch.bfloat16}
    assert torch.equal(loaded.weights.layers[1].down, reference[1].layers[1].down.to(torch.bfloat16))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_each_rank_reads_only_its_slices(tiny, reference, tmp_path, sharded, monkeypatch):
    """Rank r's weights are shard_weights' shard of the full model; each rank reads the replicated
    tensors plus 1/world of the rest, and the ranks together read every layer byte exactly once."""
    directory = copy_model(tiny, tmp_path / "m")
    if sharded:
        shard_checkpoint(directory)
    shape, full = reference
    reads = []
    original = SafetensorsSource.close

    def record(self):
        reads.append(self.bytes_read)
        original(self)

    monkeypatch.setattr(SafetensorsSource, "close", record)
    for rank in range(2):
        shard = load_target_shard(str(directory), rank, 2, CPU, torch.float32, None)
        assert shard.shape == shape
        assert_weights_equal(shard.weights, shard_weights(shape, full, rank, 2))
    total = sum(t.numel() * 4 for t in load_file(str(tiny / "model.safetensors")).values())
    replicated = sum(t.numel() * 4 for n, t in load_file(str(tiny / "model.safetensors")).items() if "proj" not in n)
    assert reads == [replicated + (total - replicated) // 2] * 2


def test_name_in_the_hugging_face_cache_resolves_to_its_snapshot(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("acme/tiny-llama", CPU, torch.float32)
    assert loaded.name == "acme/tiny-llama" and loaded.shape.num_layers == 2
    with pytest.raises(ModelLoadError, match="'acme/absent'.*Hugging Face cache"):
        load_model("acme/absent", CPU, torch.float32)


# --- broken checkpoints: each a ModelLoadError naming the file and the field -------------------------


def test_missing_shard_is_named(tiny, tmp_path):
    directory = copy_model(tiny, tmp_path / "m")
    shard_checkpoint(directory)
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"index\.json: field 'weight_map' names shard 'model-00002-of-00003"):
        load_model(str(directory), CPU, torch.float32)


def test_truncated_file_is_named(tiny, tmp_path):
    directory = copy_model(tiny, tmp_path / "m")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated: tensor '.*' field 'data_offsets' ends"):
        load_model(str(directory), CPU, torch.float32)
    path.write_bytes(data[:50])  # cut inside the header itself
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated .*header length field"):
        load_model(str(directory), CPU, torch.float32)


def test_corrupt_header_is_named(tiny, tmp_path):
    directory = copy_model(tiny, tmp_path / "m")
    path = directory / "model.safetensors"
    original = path.read_bytes()
    path.write_bytes(original[:8] + b"#" * 10 + original[18:])  # the JSON's first bytes overwritten
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt header: not JSON"):
        load_model(str(directory), CPU, torch.float32)
    header = json.loads(load_header(original))
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] += 4  # a span that does not match the tensor's shape
    write_with_header(path, original, header)
    with pytest.raises(ModelLoadError, match=rf"corrupt header: tensor '{name}' field 'data_offsets'"):
        load_model(str(directory), CPU, torch.float32)
    header[name]["data_offsets"][1] -= 4
    header[name]["dtype"] = "F8_E5M2"
    write_with_header(path, original, header)
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}': field 'dtype' 'F8_E5M2' is not supported"):
        load_model(str(directory), CPU, torch.float32)


def load_header(data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length]


def write_with_header(path: pathlib.Path, data: bytes, header: dict) -> None:
    """`data`'s tensor bytes under `header` (offsets count from the header's end: they stay valid)."""
    (length,) = struct.unpack("<Q", data[:8])
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_absent_tensor_is_named(tiny, tmp_path):
    directory = copy_model(tiny, tmp_path / "m")
    state = load_file(str(directory / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight' in model\.safetensors"
    ):
        load_model(str(directory), CPU, torch.float32)


def test_tensor_parallel_size_is_checked_before_any_weight(tiny, tmp_path):
    """3 ranks do not divide 4 heads: refused from the config alone (the weights here are unreadable)."""
    directory = copy_model(tiny, tmp_path / "m")
    (directory / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match=r"--tensor-parallel 3: .*must divide num_heads \(4\)"):
        load_target_shard(str(directory), 0, 3, CPU, torch.float32, None)
    with pytest.raises(ModelLoadError, match="model.safetensors: truncated or not safetensors"):
        load_target_shard(str(directory), 0, 2, CPU, torch.float32, None)


def test_directory_without_weights_is_named(tiny, tmp_path):
    directory = copy_model(tiny, tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no weights \(model\.safetensors, .*pytorch_model\.bin\)"):
        load_model(str(directory), CPU, torch.float32)


def test_tensors_copied_in_chunks_of_rows_are_whole(tiny, reference, monkeypatch):
    """Chunks of a few rows (each chunk's mapped pages dropped once copied): the same weights, for
    the whole model and for a rank's column slices."""
    from verifypd.model import checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 700)  # 2-3 rows of 64 float32
    shape, full = reference
    assert_weights_equal(load_model(str(tiny), CPU, torch.float32).weights, full)
    shard = load_target_shard(str(tiny), 1, 2, CPU, torch.float32, None)
    assert_weights_equal(shard.weights, shard_weights(shape, full, 1, 2))
