"""Tensor sources: checkpoint tensors by name, converted once to the serving dtype on the serving
device, cut to one tensor-parallel rank's slice (model.families.shard_rule).

    SafetensorsSource  a checkpoint directory's model.safetensors or sharded index, memory-mapped
    StateDictSource    over an in-memory state dict (GGUF through transformers, tests)

`read_torch_bin` reads a `pytorch_model.bin` state dict without running code from the file.

Host memory while loading from safetensors (model.safetensors_file): a tensor is a view of the
file's mapping; a rank narrows it to its slice (nothing read yet) and copies that once to the device
in chunks of rows (on a GPU through pinned buffers, converted there), dropping each chunk's mapped
pages once copied (MADV_DONTNEED: the page cache keeps them, the process's resident set does not).
So beside the weights themselves (nothing, on a GPU) the host holds about one chunk of the file.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import warnings
from collections.abc import Callable, Mapping

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.families import ShardRule
from verifypd.model.safetensors_file import INDEX_FILE, SINGLE_FILE, SafetensorsFile, checkpoint_files

CHUNK_BYTES = 32 << 20  # rows copied at a time: the host's peak of mapped pages while loading


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


def check_cast(name: str, stored: torch.dtype, wanted: torch.dtype) -> None:
    """FP8 tensors are read only as FP8 (with their scales, model.fp8_load): a plain cast would drop
    the scales and serve wrong weights."""
    if stored == torch.float8_e4m3fn and wanted != stored:
        raise ModelLoadError(
            f"tensor {name!r} is FP8 (F8_E4M3) and is read here as {str(wanted).removeprefix('torch.')}: "
            "FP8 checkpoints must name their scheme in config.json 'quantization_config' (compressed-tensors or "
            "fbgemm_fp8), and only the dense attention and MLP projections may be FP8"
        )


class StateDictSource:
    """A TensorSource over a state dict held in host memory."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        rule: Callable[[str, tuple[int, ...]], ShardRule] = lambda name, stored: None,
        rank: int = 0,
        world: int = 1,
    ):
        self.state, self.device, self.dtype = state, device, dtype
        self.rule, self.rank, self.world = rule, rank, world

    def has(self, name: str) -> bool:
        return name in self.state

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        check_cast(name, self.state[name].dtype, dtype or self.dtype)
        t = rank_slice(self.state[name], self.rule(name, tuple(self.state[name].shape)), self.rank, self.world, name)
        # copy=True: owned even when nothing changes (a state dict may map a file that can be rewritten)
        return t.to(device=self.device, dtype=dtype or self.dtype, copy=True)


class SafetensorsSource:
    """A TensorSource over a directory's safetensors checkpoint, memory-mapped, read tensor by tensor.

    `get` narrows the mapped tensor to this rank's slice, copies those bytes once to the device, and
    converts the dtype there. `bytes_read` counts the checkpoint bytes this rank copied."""

    def __init__(
        self,
        directory: pathlib.Path,
        device: torch.device,
        dtype: torch.dtype,
        rule: Callable[[str, tuple[int, ...]], ShardRule] = lambda name, stored: None,
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
        self.pinned: PinnedStaging | None = None

    def has(self, name: str) -> bool:
        return name in self.where

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.where[name].entries[name].dtype

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        file = self.where.get(name)
        if file is None:
            files = ", ".join(sorted(f.path.name for f in self.files))
            raise ModelLoadError(f"checkpoint {self.directory}: no tensor {name!r} in {files}")
        check_cast(f"{file.path}: {name}", file.entries[name].dtype, dtype or self.dtype)
        rule = self.rule(name, file.entries[name].shape)
        base = file.view(name)
        parts = [
            self.materialise(file, name, base, v, dtype or self.dtype)
            for v in rank_parts(base, rule, self.rank, self.world, name)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0 if rule is None else rule[0])

    def materialise(
        self, file: SafetensorsFile, name: str, base: torch.Tensor, view: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """One copy of `view` (a slice of the mapping) owned by the device, in `dtype`: copied in chunks
        of rows, each chunk's mapped pages dropped once copied (the host's peak: one chunk)."""
        self.bytes_read += view.numel() * view.element_size()
        host = self.device.type == "cpu"
        # On the host: read and convert in one pass. On a GPU: the checkpoint's bytes go over as they
        # are and are converted there (bf16 moves half the bytes of fp32; the host never converts).
        out = torch.empty(view.shape, dtype=dtype if host else view.dtype, device=self.device)
        if view.dim() == 0 or view.numel() == 0:
            out.copy_(view)
            return out.to(dtype)
        rows = max(1, CHUNK_BYTES // max(1, view[0].numel() * view.element_size()))
        for first in range(0, view.shape[0], rows):
            chunk = view[first : first + rows]
            if host:
                out[first : first + rows].copy_(chunk)
            else:
                self.staging().copy(chunk, out[first : first + rows])
            file.release(name, base, chunk)
        return out if host else out.to(dtype)

    def staging(self) -> PinnedStaging:
        if self.pinned is None:
            self.pinned = PinnedStaging(self.device)
        return self.pinned

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.finish()
        for f in self.files:
            f.close()


class PinnedStaging:
    """Host-to-GPU copies through two pinned buffers: the CPU fills one from the file's mapping while
    the GPU copies the other (a pageable copy would stage through the driver's buffers serially)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (contiguous, on the GPU) <- src (host, any strides); returns once src was read."""
        i, self.turn = self.turn, 1 - self.turn
        previous = self.done[i]
        if previous is not None:
            previous.synchronize()  # the GPU finished reading this buffer
        nbytes = src.numel() * src.element_size()
        if nbytes > self.buffers[i].numel():  # a row longer than a chunk
            self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self.buffers[i][:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        with torch.cuda.device(self.device):
            dst.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.done[i] = event

    def finish(self) -> None:
        for event in self.done:
            if event is not None:
                event.synchronize()


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
