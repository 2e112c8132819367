"""Builds the co-located engine: models, KV pools, in-process lanes and the router.

`Engine.generate` is the offline path (CLI `--offline`, tests); servers drive `engine.router`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verifypd.engine.draft_length import RuntimeConfig
from verifypd.engine.router import EngineObserver, Router
from verifypd.engine.types import RequestOutput, RequestSpec
from verifypd.lanes.interface import LaneInfo
from verifypd.lanes.local import LocalDraftLane, LocalPrefillLane, LocalVerifyLane
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import LoadedModel, ModelLoadError, load_model
from verifypd.model.runner import ModelRunner
from verifypd.tokenizer import TextCodec

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "self:12"


@dataclass
class EngineOptions:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT       # "self:N" = the target's first N layers, or another model spec
    device: str = "auto"             # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"              # "auto" (bf16 on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_blocks: int | None = None    # per pool; None = sized from memory
    max_context: int | None = 4096
    max_running: int = 256
    gpu_memory_fraction: float = 0.85
    shared_cpu_pools: bool = False   # CPU pools in /dev/shm (needed when split lanes import them)
    cuda_graphs: bool = True         # on CUDA: capture graphs per batch bucket at start-up
    graph_buckets: tuple[int, ...] | None = None  # padded batch sizes of the graphs (None = 1, 2, 4 .. 256)
    config: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class Models:
    target: LoadedModel
    target_model: PagedLlama
    draft_model: PagedLlama
    draft_name: str
    device: torch.device
    dtype: torch.dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def self_draft_layers(draft: str, target_layers: int) -> int:
    """N of a "self:N" draft spec, checked against the target's depth."""
    try:
        layers = int(draft.removeprefix("self:"))
    except ValueError:
        raise ModelLoadError(f"--draft self:N needs an integer N, got {draft!r}") from None
    if not (1 <= layers <= target_layers):
        raise ModelLoadError(f"--draft self:N needs 1 <= N <= {target_layers}, got {layers}")
    return layers


def load_models(options: EngineOptions) -> Models:
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    target = load_model(options.target, device, dtype, options.max_context)
    target_model = PagedLlama(target.shape, target.weights)
    if options.draft.startswith("self:"):
        layers = self_draft_layers(options.draft, target.shape.num_layers)
        draft_model = PagedLlama(target.shape, target.weights, num_layers=layers)
    else:
        draft = load_model(options.draft, device, dtype, options.max_context)
        if draft.shape.vocab_size != target.shape.vocab_size:
            raise ModelLoadError(f"draft vocabulary ({draft.shape.vocab_size}) differs from the target's "
                                 f"({target.shape.vocab_size}): they must share a tokenizer")
        draft_model = PagedLlama(draft.shape, draft.weights)
    return Models(target, target_model, draft_model, options.draft, device, dtype)


def make_pools(models: Models, options: EngineOptions) -> tuple[KvPool, KvPool]:
    def geometry(model: PagedLlama, blocks: int) -> PoolGeometry:
        s = model.shape
        return PoolGeometry(model.num_layers, blocks, options.block_size, s.num_kv_heads, s.head_dim)

    blocks = options.num_blocks
    if blocks is None:
        per_block = sum(geometry(m, 1).bytes_per_block(models.dtype) for m in (models.target_model, models.draft_model))
        if models.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(models.device)
            blocks = int(free * options.gpu_memory_fraction) // per_block
        else:  # enough for max_running short requests without taking the host's memory
            blocks = min(4096, max(256, (1 << 30) // per_block))
    pools = []
    for role, model in (("target", models.target_model), ("draft", models.draft_model)):
        g = geometry(model, blocks)
        if options.shared_cpu_pools and models.device.type == "cpu":
            pools.append(KvPool.create_shared_cpu(role, g, models.dtype))
        else:
            pools.append(KvPool(role, g, models.dtype, models.device))
    return pools[0], pools[1]


def capture_graphs(target: ModelRunner, draft: ModelRunner, k_max: int) -> float:
    """Captures the CUDA graphs the lanes use at start-up (others on first use); returns seconds."""
    seconds = 0.0
    if target.graphs is not None:
        seconds += target.graphs.warm_up(("all",), max_query=min(k_max + 1, target.graphs.max_query))
    if draft.graphs is not None:
        seconds += draft.graphs.warm_up(("last", "draft"))  # "last" up to 9 tokens: short catch-ups
    return seconds


class Engine:
    def __init__(self, options: EngineOptions | None = None, observer: EngineObserver | None = None,
                 models: Models | None = None, *, simulated_acceptance: float | None = None):
        """`simulated_acceptance` is for benchmarks only (see LocalVerifyLane); no CLI or RPC sets it."""
        self.options = options or EngineOptions()
        self.models = models or load_models(self.options)
        m = self.models
        self.codec = TextCodec(m.target.tokenizer)
        self.target_pool, self.draft_pool = make_pools(m, self.options)
        graphs = None if self.options.cuda_graphs else False
        buckets = self.options.graph_buckets
        target_runner = ModelRunner(m.target_model, self.target_pool, graphs=graphs, buckets=buckets)
        draft_runner = ModelRunner(m.draft_model, self.draft_pool, graphs=graphs, buckets=buckets)
        self.startup_capture_seconds = capture_graphs(target_runner, draft_runner, self.options.config.k_max)
        common = dict(vocab_size=m.target.shape.vocab_size, max_context=m.target.shape.max_context,
                      target_model=m.target.name, draft_model=m.draft_name)
        pools = (self.target_pool.info(), self.draft_pool.info())
        self.prefill_lane = LocalPrefillLane(target_runner, draft_runner, LaneInfo("prefill", pools, **common))
        self.draft_lane = LocalDraftLane(draft_runner, LaneInfo("draft", (pools[1],), **common))
        self.verify_lane = LocalVerifyLane(target_runner, LaneInfo("verify", (pools[0],), **common),
                                           simulated_acceptance=simulated_acceptance)
        self.router = Router(self.prefill_lane, self.draft_lane, self.verify_lane, decode=self.codec.decode,
                             eos_token_ids=m.target.eos_token_ids, config=self.options.config,
                             max_running=self.options.max_running, observer=observer)

    def generate(self, specs: list[RequestSpec]) -> dict[str, "Completion"]:
        """Runs requests to completion (offline); returns completions by request id."""
        ids = [self.router.add_request(s) for s in specs]
        done: dict[str, Completion] = {i: Completion(i) for i in ids}
        while self.router.has_work():
            for out in self.router.step():
                done[out.request_id].add(out)
        return done


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    applied_k: list[int] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.applied_k.append(out.applied_k)
        self.usage = out.stats.usage()
        self.ttft_s = out.stats.ttft
        if out.finished:
            self.finish_reason = out.finish_reason.value
            self.elapsed_s = (out.stats.token_times[-1] if out.stats.token_times else time.monotonic()) - out.stats.arrival_time
