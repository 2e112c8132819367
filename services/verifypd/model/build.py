"""Building one process's models and KV pools from resolved options (torch and domain only).

    resolve_device / resolve_dtype   "auto" and friends -> torch objects
    load_draft_model                 the draft's weights, for the draft kinds that have any
    load_models -> Models            target + draft of a single-process target
    make_pools                       the target's and the draft's KV pools, sized from memory
    capture_graphs                   the CUDA graphs the lanes use, at start-up

A target over several ranks is loaded by verifypd.lanes.tensor_parallel.assembly (it starts
processes); the stacks are put together by verifypd.core.assembly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from verifypd.domain.drafts import DraftSpec
from verifypd.domain.models import ModelLoadError, draft_spec, self_draft_layers
from verifypd.domain.options import EngineOptions
from verifypd.model.eagle_draft import EagleModel, EagleRunner
from verifypd.model.eagle_head import load_eagle_head
from verifypd.model.features import FeaturePool
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.kv_quant import kv_cache_dtype
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import LoadedModel, load_model
from verifypd.model.runner import ModelRunner

log = logging.getLogger("verifypd.model")


class RankSet(Protocol):
    """What building a target over several ranks needs of its follower ranks
    (lanes.tensor_parallel.ranks.LeaderRanks)."""

    def agreed_blocks(self, blocks: int) -> int:
        """The pool size in blocks every rank can hold (the smallest of the ranks' budgets)."""
        ...

    def target_pool(self, make: Callable[[], KvPool]) -> KvPool:
        """Rank 0's target pool: made once by `make`, the same one after."""
        ...

    def runner(
        self,
        model: PagedLlama,
        pool: KvPool,
        graphs: bool | str | None = None,
        buckets: tuple[int, ...] | None = None,
    ) -> ModelRunner:
        """Rank 0's target runner over `pool` (each forward is sent to the followers first)."""
        ...

    def wait_ready(self) -> list[bytes]:
        """Each follower's start-up answer, in rank order, once it is ready."""
        ...


@dataclass
class Models:
    target: LoadedModel
    target_model: PagedLlama
    draft_model: PagedLlama | EagleModel | None  # None: a pool-less draft (ngram, none)
    draft_name: str
    device: torch.device
    dtype: torch.dtype
    # --tensor-parallel > 1: the follower ranks (lanes.tensor_parallel.ranks.LeaderRanks); target.weights
    # and target_model then hold rank 0's shard (target.shape stays the full model's).
    ranks: RankSet | None = None
    # The KV pools' element type (`--kv-cache-dtype`, model.kv_quant); None: `dtype`. The feature pool
    # of an EAGLE head stays in `dtype` (hidden states, not K/V).
    kv_dtype: torch.dtype | None = None


def resolve_device(name: str) -> torch.device:
    """The device of `name` ("auto": a GPU if there is one). A numbered GPU also becomes this thread's
    current device: Triton launches and CUDA graphs run on the current device, whatever the tensors'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_draft_model(
    spec: DraftSpec, target: LoadedModel | None, device, dtype, max_context: int | None
) -> PagedLlama | EagleModel | None:
    """The draft's weights, for kinds that have any (the loader entry of a model draft kind)."""
    if spec.kind == "eagle":
        if target is None:
            raise ModelLoadError(
                f"--draft {spec.text} reads the target's hidden states: it runs beside the target "
                "(co-located), not in a lane of its own"
            )
        config, weights = load_eagle_head(spec.model, target.shape, target.weights.lm_head, device, dtype)
        return EagleModel(config, weights, target.weights.embed)
    if spec.kind == "self":
        if target is None:
            raise ModelLoadError(f"--draft {spec.text} runs on the target's own weights: load the target first")
        return PagedLlama(
            target.shape, target.weights, num_layers=self_draft_layers(spec.text, target.shape.num_layers)
        )
    if spec.kind == "model":
        draft = load_model(spec.model, device, dtype, max_context)
        if target is not None and draft.shape.vocab_size != target.shape.vocab_size:
            raise ModelLoadError(
                f"draft vocabulary ({draft.shape.vocab_size}) differs from the target's "
                f"({target.shape.vocab_size}): they must share a tokenizer"
            )
        return PagedLlama(draft.shape, draft.weights)
    return None  # pool-less kinds load nothing


def load_models(options: EngineOptions) -> Models:
    """The target (whole, in this process) and the draft. --tensor-parallel > 1 starts rank
    processes: verifypd.lanes.tensor_parallel.assembly.load_tensor_parallel loads those."""
    if options.tensor_parallel != 1:
        raise ModelLoadError(
            f"--tensor-parallel {options.tensor_parallel}: load the target with "
            "verifypd.lanes.tensor_parallel.assembly.load_tensor_parallel"
        )
    spec = draft_spec(options.draft)  # a bad --draft fails before the target is loaded
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    kv_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype, device)  # a bad flag fails before loading
    target = load_model(options.target, device, dtype, options.max_context, options.quantization)
    target_model = PagedLlama(target.shape, target.weights)
    draft_model = load_draft_model(spec, target, device, dtype, options.max_context)
    return Models(target, target_model, draft_model, options.draft, device, dtype, kv_dtype=kv_dtype)


def make_pools(models: Models, options: EngineOptions) -> tuple[KvPool, KvPool | None]:
    def geometry(model: PagedLlama | EagleModel, blocks: int) -> PoolGeometry:
        s = model.shape
        return PoolGeometry(model.num_layers, blocks, options.block_size, s.num_kv_heads, s.head_dim)

    kv_dtype = models.kv_dtype or models.dtype
    blocks = options.num_blocks
    if blocks is None:
        per_block = sum(
            geometry(m, 1).bytes_per_block(kv_dtype) for m in (models.target_model, models.draft_model) if m is not None
        )
        if isinstance(models.draft_model, EagleModel):  # its feature pool lives beside the target's KV
            per_block += options.block_size * FeaturePool.bytes_per_slot(
                len(models.draft_model.config.aux_layer_ids), models.target_model.shape.hidden_size, models.dtype
            )
        if models.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(models.device)
            blocks = int(free * options.gpu_memory_fraction) // per_block
        else:  # enough for max_running short requests without taking the host's memory
            blocks = min(4096, max(256, (1 << 30) // per_block))
    if models.ranks is not None:  # block ids are shared by the ranks: every pool gets the smallest budget
        blocks = models.ranks.agreed_blocks(blocks)

    def pool(role: str, model: PagedLlama | EagleModel) -> KvPool:
        g = geometry(model, blocks)
        if options.shared_cpu_pools and models.device.type == "cpu":
            kv = KvPool.create_shared_cpu(role, g, kv_dtype)
        else:
            kv = KvPool(role, g, kv_dtype, models.device)
        kv.window = pool_window(model)
        return kv

    target = (
        pool("target", models.target_model)
        if models.ranks is None
        else models.ranks.target_pool(lambda: pool("target", models.target_model))
    )  # one per rank set
    draft = pool("draft", models.draft_model) if models.draft_model is not None else None
    for p in (target, draft):
        if p is not None:
            log.info("%s", p.summary())
    return target, draft


def capture_graphs(
    target: ModelRunner | None, draft: ModelRunner | EagleRunner | None, k_max: int, prefill: bool = True
) -> float:
    """Captures the CUDA graphs the lanes use at start-up (others on first use); returns seconds.
    A lane process passes only the runner it serves. `prefill`: also the one-sequence prefill graphs
    (ModelRunner.capture_prefill_graphs), not for tensor-parallel ranks (their prefill forwards pair
    collectives with the other ranks' eager ones)."""
    seconds = 0.0
    for runner in (target, draft):
        if prefill and runner is not None and type(runner) in (ModelRunner, EagleRunner):  # not LeaderRunner
            seconds += runner.capture_prefill_graphs()
    if target is not None and target.graphs is not None:
        kinds = ("all", "accept") if k_max > 0 else ("all",)  # "accept": greedy verify calls with drafts
        seconds += target.graphs.warm_up(kinds, max_query=min(k_max + 1, target.graphs.max_query))
    if isinstance(draft, EagleRunner):  # a feature draft's call graphs
        if draft.graphs is not None:
            seconds += draft.graphs.warm_up(max_query=k_max + 1, max_steps=k_max)
    elif draft is not None and draft.graphs is not None:  # None: pool-less draft
        seconds += draft.graphs.warm_up(("last", "draft"))  # "last" up to 9 tokens: short catch-ups
    return seconds


def pool_window(model: PagedLlama | EagleModel) -> int:
    """PoolInfo.window of `model`'s KV pool: its window when every layer it runs slides (Mistral,
    Phi-3, a self-draft of their first layers), else 0 (Gemma 2/3 mix local and global layers; an
    EAGLE head's layer sees the whole context): the router frees only behind a window all layers share."""
    if not isinstance(model, PagedLlama):
        return 0
    windows = {model.shape.window(i) for i in range(model.num_layers)}
    return windows.pop() if len(windows) == 1 else 0
