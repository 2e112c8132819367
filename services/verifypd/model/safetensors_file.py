"""One safetensors file, its header checked against the file, its bytes memory-mapped; and which
files a checkpoint directory's tensors are in (model.safetensors or a sharded index).

Layout of a file: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the header's
end. Every check names the file and the field, as a ModelLoadError.
"""

from __future__ import annotations

import json
import mmap
import pathlib
import struct
from dataclasses import dataclass

import torch

from verifypd.domain.models import ModelLoadError

# safetensors dtype names -> torch. F8_E4M3 is read only as what it is: FP8 projections come with
# scales (model.fp8_load), and a plain cast to another dtype is refused (checkpoint.py). E5M2 and
# the other 8-bit float kinds are not supported.
DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
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

    def release(self, name: str, base: torch.Tensor, part: torch.Tensor) -> None:
        """Drops the mapped pages under `part` (rows of a view of `base` = view(name)) from the
        resident set; the page cache keeps them."""
        entry = self.entries[name]
        if self.mapping is None or part.numel() == 0:
            return
        start = entry.start + (part.data_ptr() - base.data_ptr())
        end = min(start + part.shape[0] * part.stride(0) * part.element_size(), entry.end) if part.dim() else start
        start -= start % mmap.PAGESIZE  # madvise wants a page-aligned start
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

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
