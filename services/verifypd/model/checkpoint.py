"""Tensor sources: checkpoint tensors by name, converted once to the serving dtype on the serving
device, cut to one tensor-parallel rank's slice (model.families.shard_rule).

    SafetensorsSource  a checkpoint directory's model.safetensors or sharded index, memory-mapped
    StateDictSource    over an in-memory state dict (GGUF through transformers, tests)

`read_torch_bin` reads a `pytorch_model.bin` state dict without running code from the file.

Host memory while loading from safetensors: a tensor is a view of the file's mapping; a rank narrows
it to its slice (nothing read yet), copies that once to the device (converting there), and then
drops the mapping's pages of that tensor again (MADV_DONTNEED: they stay in the page cache, but no
longer count in the process's resident set). So the host holds at most one tensor's pages of the
file beside whatever the weights themselves take (nothing more on a GPU).
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import pickle
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.families import ShardRule

# safetensors dtype names -> torch. FP8 is left out on purpose: FP8 checkpoints carry scales that a
# plain cast would ignore.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # the safetensors format's own bound on the JSON header


def rank_parts(tensor: torch.Tensor, rule: ShardRule, rank: int, world: int, name: str = "") -> list[torch.Tensor]:
    """Views of rank `rank`'s parts of `tensor` under `rule` (one part unless the rule has sections);
    nothing is read or copied."""
    if rule is None or world == 1:
        return [tensor]
    dim, sections = rule
    sizes = sections or (tensor.shape[dim],)
    if sum(sizes) != tensor.shape[dim]:
        raise ModelLoadError(f"tensor {name!r}: dim {dim} has {tensor.shape[dim]} entries, expected {sum(sizes)}")
    parts, start = [], 0
    for size in sizes:
        if size % world:
            raise ModelLoadError(f"tensor {name!r}: {size} entries along dim {dim} do not divide into {world} ranks")
        piece = size // world
        parts.append(tensor.narrow(dim, start + rank * piece, piece))
        start += size
    return parts


def rank_slice(tensor: torch.Tensor, rule: ShardRule, rank: int, world: int, name: str = "") -> torch.Tensor:
    """Rank `rank`'s part of `tensor` under `rule` (a view when it is one slice, else a copy)."""
    parts = rank_parts(tensor, rule, rank, world, name)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0 if rule is None else rule[0])


class StateDictSource:
    """A TensorSource over a state dict held in host memory."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        rule: Callable[[str], ShardRule] = lambda name: None,
        rank: int = 0,
        world: int = 1,
    ):
        self.state, self.device, self.dtype = state, device, dtype
        self.rule, self.rank, self.world = rule, rank, world

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        t = rank_slice(self.state[name], self.rule(name), self.rank, self.world, name)
        # copy=True: owned even when nothing changes (a state dict may map a file that can be rewritten)
        return t.to(device=self.device, dtype=dtype or self.dtype, copy=True)


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file (header included)
    end: int


class SafetensorsFile:
    """One .safetensors file: its header checked against the file's size, its bytes mapped on first use.

    Layout: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
    [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the end of the header."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self.error(f"{size} bytes is too short for a safetensors header")
                (length,) = struct.unpack("<Q", head)
                if length > MAX_HEADER or 8 + length > size:
                    raise self.error(
                        f"truncated or not safetensors: the header length field says {length} bytes, "
                        f"the file has {size}"
                    )
                raw = f.read(length)
        except OSError as exc:
            raise self.error(f"cannot read ({exc.strerror or exc})") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self.error(f"corrupt header: not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self.error("corrupt header: not a JSON object")
        base = 8 + length
        self.entries: dict[str, TensorEntry] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            self.entries[name] = self.check_entry(name, meta, base, size)
        self.size = size
        self.mapping: mmap.mmap | None = None

    def error(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"checkpoint file {self.path}: {what}")

    def check_entry(self, name: str, meta: object, base: int, size: int) -> TensorEntry:
        if not isinstance(meta, dict):
            raise self.error(f"corrupt header: the entry of tensor {name!r} is not an object")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in DTYPES:
            raise self.error(f"tensor {name!r}: field 'dtype' {dtype!r} is not supported ({', '.join(DTYPES)} are)")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self.error(f"corrupt header: tensor {name!r} field 'shape' {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise self.error(f"corrupt header: tensor {name!r} field 'data_offsets' {offsets!r} is not [begin, end]")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPES[dtype].itemsize
        if begin < 0 or end - begin != nbytes:
            raise self.error(
                f"corrupt header: tensor {name!r} field 'data_offsets' {offsets} spans {end - begin} bytes, "
                f"its dtype and shape need {nbytes}"
            )
        if base + end > size:
            raise self.error(
                f"truncated: tensor {name!r} field 'data_offsets' ends at byte {base + end}, the file has {size}"
            )
        return TensorEntry(DTYPES[dtype], tuple(shape), base + begin, base + end)

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file's mapping (reads nothing until used)."""
        entry = self.entries[name]
        if entry.start == entry.end:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self.mapping is None:
            with self.path.open("rb") as f:
                # Copy-on-write private mapping: writable for torch.frombuffer (no warning), never written.
                self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        numel = (entry.end - entry.start) // entry.dtype.itemsize
        flat = torch.frombuffer(self.mapping, dtype=entry.dtype, count=numel, offset=entry.start)
        return flat.view(entry.shape)

    def release(self, name: str) -> None:
        """Drops this tensor's mapped pages from the resident set (the page cache keeps them)."""
        entry = self.entries[name]
        if self.mapping is None or entry.start == entry.end:
            return
        page = mmap.PAGESIZE
        start = entry.start - entry.start % page
        self.mapping.madvise(mmap.MADV_DONTNEED, start, min(entry.end, self.size) - start)

    def close(self) -> None:
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a tensor still views it (a caller kept a view): unmapped when freed
                pass
            self.mapping = None


def checkpoint_files(directory: pathlib.Path) -> dict[str, pathlib.Path] | None:
    """Tensor name -> file of a directory's safetensors checkpoint (sharded index or one file); None
    when the directory has neither. Every file the index names must exist."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"checkpoint index {index}: field 'weight_map' unreadable ({exc})") from None
        files: dict[str, pathlib.Path] = {}
        for name, file in weight_map.items():
            path = directory / str(file)
            if not path.is_file():
                raise ModelLoadError(
                    f"checkpoint index {index}: field 'weight_map' names shard {file!r} (tensor {name!r}), "
                    f"which is missing from {directory}"
                )
            files[name] = path
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return {"": single}  # "" : every tensor of the one file
    return None


class SafetensorsSource:
    """A TensorSource over a directory's safetensors checkpoint, memory-mapped, read tensor by tensor.

    `get` narrows the mapped tensor to this rank's slice, copies those bytes once to the device, and
    converts the dtype there. `bytes_read` counts the checkpoint bytes this rank copied."""

    def __init__(
        self,
        directory: pathlib.Path,
        device: torch.device,
        dtype: torch.dtype,
        rule: Callable[[str], ShardRule] = lambda name: None,
        rank: int = 0,
        world: int = 1,
    ):
        names = checkpoint_files(directory)
        if names is None:
            raise ModelLoadError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.directory, self.device, self.dtype = directory, device, dtype
        self.rule, self.rank, self.world = rule, rank, world
        opened: dict[pathlib.Path, SafetensorsFile] = {}
        for path in dict.fromkeys(names.values()):  # every header is checked before any weight is read
            opened[path] = SafetensorsFile(path)
        self.files = list(opened.values())
        self.where: dict[str, SafetensorsFile] = {}
        for name, path in names.items():
            if name:
                if name not in opened[path].entries:
                    raise ModelLoadError(f"checkpoint index names tensor {name!r} in {path}, whose header lacks it")
                self.where[name] = opened[path]
            else:
                self.where.update((n, opened[path]) for n in opened[path].entries)
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        file = self.where.get(name)
        if file is None:
            files = ", ".join(sorted(f.path.name for f in self.files))
            raise ModelLoadError(f"checkpoint {self.directory}: no tensor {name!r} in {files}")
        rule = self.rule(name)
        views = rank_parts(file.view(name), rule, self.rank, self.world, name)
        parts = [self.materialise(v, dtype or self.dtype) for v in views]
        del views
        file.release(name)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0 if rule is None else rule[0])

    def materialise(self, view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One copy of `view` (a slice of the mapping) owned by the device, in `dtype`."""
        self.bytes_read += view.numel() * view.element_size()
        if self.device.type == "cpu":
            out = torch.empty(view.shape, dtype=dtype)
            out.copy_(view)  # reads the mapped bytes and converts in one pass
            return out
        # The checkpoint's bytes go to the device as they are and are converted there (bf16 -> the
        # GPU moves half the bytes of an fp32 host copy, and the host never holds a converted copy).
        return view.to(self.device).to(dtype)

    def close(self) -> None:
        for f in self.files:
            f.close()


def read_torch_bin(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """A `torch.save`d state dict (pytorch_model.bin), memory-mapped where the format allows.

    weights_only=True: torch's restricted unpickler, which rebuilds tensors, plain containers and
    numbers only and refuses every other global (os.system, any class), so a published file cannot
    run code here as a plain pickle.load would. Anything but a dict of tensors is refused too."""

    def load(mapped: bool):
        with warnings.catch_warnings():  # "pickle protocol 4": torch reads it, the warning is noise
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)

    try:
        try:
            state = load(True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = load(False)  # the legacy (pre-zip) format cannot be mapped: read whole
    except pickle.UnpicklingError as exc:
        reason = unpickler_reason(exc)
        raise ModelLoadError(f"checkpoint file {path}: refused, it holds more than tensors ({reason})") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise ModelLoadError(f"checkpoint file {path}: not a readable torch state dict ({exc})") from None
    tensors = isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())
    if not tensors:
        raise ModelLoadError(f"checkpoint file {path}: refused, not a dict of named tensors")
    return state


def unpickler_reason(exc: Exception) -> str:
    """The restricted unpickler's own reason, without torch's advice around it (which is to turn the
    protection off)."""
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue", "(1)", "(2)")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.strip().startswith(advice)]
    if not lines:
        return type(exc).__name__
    return lines[0].removeprefix("WeightsUnpickler error:").split(". Please use")[0].strip()


def resolve_checkpoint_dir(spec: str) -> pathlib.Path | None:
    """`spec` as a local directory, or the snapshot directory of a name already in the Hugging Face
    cache (nothing is downloaded); None when it is neither."""
    if os.path.isdir(spec):
        return pathlib.Path(spec)
    if spec.count("/") > 1 or spec.startswith((".", "/")):
        return None  # a path that does not exist, not a hub name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(spec, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None
