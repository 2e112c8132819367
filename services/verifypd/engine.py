"""Builds the co-located engine: models, KV pools, in-process lanes and the router.

`Engine.generate` is the offline path (CLI `--offline`, tests); servers drive `engine.router`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.defaults import DEFAULT_TARGET
from verifypd.domain.drafts import DEFAULT_DRAFT, DraftSpec, DraftSpecError, parse_draft
from verifypd.domain.lanes import LaneInfo
from verifypd.domain.requests import RequestOutput, RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.lanes.local import LocalDraftLane, LocalPrefillLane, LocalVerifyLane
from verifypd.model.eagle_draft import EagleModel, EagleRunner, attach_features
from verifypd.model.eagle_head import load_eagle_head
from verifypd.model.features import FeaturePool
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import LoadedModel, ModelLoadError, load_model
from verifypd.model.runner import ModelRunner
from verifypd.router.router import EngineObserver, Router
from verifypd.spec_decode.lookup_mix import LookupMix
from verifypd.spec_decode.ngram import poolless_draft_lane


@dataclass
class EngineOptions:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT  # see verifypd.domain.drafts: ngram[:MIN-MAX] | none | self:N | a model spec
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_blocks: int | None = None  # per pool; None = sized from memory
    max_context: int | None = 4096
    max_running: int = 256
    gpu_memory_fraction: float = 0.85
    shared_cpu_pools: bool = False  # CPU pools in /dev/shm (needed when split lanes import them)
    cuda_graphs: bool = True  # on CUDA: capture graphs per batch bucket at start-up
    graph_buckets: tuple[int, ...] | None = None  # padded batch sizes of the graphs (None = 1, 2, 4 .. 256)
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    # BENCHMARK ONLY (`--simulated-acceptance`): real draft and verify compute, but each draft token is
    # kept with this probability (seeded Bernoulli, see LocalVerifyLane): output is NOT the target's.
    simulated_acceptance: float | None = None
    # The target over this many ranks, one process (and GPU) each: this process is rank 0
    # (lanes/tensor_parallel/ranks.py); 1 = today's single-process target.
    tensor_parallel: int = 1


@dataclass
class Models:
    target: LoadedModel
    target_model: PagedLlama
    draft_model: PagedLlama | EagleModel | None  # None: a pool-less draft (ngram, none)
    draft_name: str
    device: torch.device
    dtype: torch.dtype
    # --tensor-parallel > 1: the follower ranks (tp_ranks.LeaderRanks); target.weights and
    # target_model then hold rank 0's shard (target.shape stays the full model's).
    ranks: object | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def draft_spec(draft: str) -> DraftSpec:
    """parse_draft with the CLI's error type (a bad --draft exits 2 with the message)."""
    try:
        return parse_draft(draft)
    except DraftSpecError as exc:
        raise ModelLoadError(str(exc)) from None


def self_draft_layers(draft: str, target_layers: int) -> int:
    """N of a "self:N" draft spec, checked against the target's depth (the message gives the range)."""
    try:
        return draft_spec(draft).check_layers(target_layers)
    except DraftSpecError as exc:
        raise ModelLoadError(str(exc)) from None


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
    spec = draft_spec(options.draft)  # a bad --draft fails before the target is loaded
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    if options.tensor_parallel != 1:
        return load_tensor_parallel(options, spec, device, dtype)
    target = load_model(options.target, device, dtype, options.max_context)
    target_model = PagedLlama(target.shape, target.weights)
    draft_model = load_draft_model(spec, target, device, dtype, options.max_context)
    return Models(target, target_model, draft_model, options.draft, device, dtype)


def load_tensor_parallel(options: EngineOptions, spec: DraftSpec, device, dtype) -> Models:
    """Rank 0 of a target sharded over `options.tensor_parallel` processes (lanes/tensor_parallel/ranks.py): its
    shard, the started followers, and the draft (whole, on rank 0's device)."""
    from verifypd.lanes.tensor_parallel import ranks as tp_ranks
    from verifypd.model.tensor_parallel import load_target_shard, shard_shape

    world = options.tensor_parallel
    tp_ranks.check_devices(device, world)
    if spec.kind in ("self", "eagle"):
        raise ModelLoadError(
            f"--draft {spec.text} runs on the target's own weights or hidden states, which "
            f"--tensor-parallel {world} splits across ranks: use a draft model, ngram or none"
        )
    target = load_target_shard(options.target, 0, world, device, dtype, options.max_context)  # checks divisibility
    draft_model = load_draft_model(spec, target, device, dtype, options.max_context)
    ranks = tp_ranks.LeaderRanks(world, device, follower_options(options, dtype, pool="private"))
    target_model = PagedLlama(shard_shape(target.shape, world), target.weights)
    target_model.tp_group = ranks.group
    return Models(target, target_model, draft_model, options.draft, device, dtype, ranks=ranks)


def follower_options(options: EngineOptions, dtype: torch.dtype, pool: str, generation: int = 1) -> dict:
    """What a follower rank needs to build the same target runner (tp_follower's --options; `pool`:
    private | shared | import, see there)."""
    return dict(
        pool=pool,
        generation=generation,
        target=options.target,
        dtype=str(dtype).removeprefix("torch."),
        max_context=options.max_context,
        block_size=options.block_size,
        num_blocks=options.num_blocks,
        gpu_memory_fraction=options.gpu_memory_fraction,
        cuda_graphs=options.cuda_graphs,
        graph_buckets=list(options.graph_buckets) if options.graph_buckets else None,
        k_max=options.config.k_max,
    )


def make_pools(models: Models, options: EngineOptions) -> tuple[KvPool, KvPool | None]:
    def geometry(model: PagedLlama, blocks: int) -> PoolGeometry:
        s = model.shape
        return PoolGeometry(model.num_layers, blocks, options.block_size, s.num_kv_heads, s.head_dim)

    blocks = options.num_blocks
    if blocks is None:
        per_block = sum(
            geometry(m, 1).bytes_per_block(models.dtype)
            for m in (models.target_model, models.draft_model)
            if m is not None
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

    def pool(role: str, model) -> KvPool:
        g = geometry(model, blocks)
        if options.shared_cpu_pools and models.device.type == "cpu":
            return KvPool.create_shared_cpu(role, g, models.dtype)
        return KvPool(role, g, models.dtype, models.device)

    target = (
        pool("target", models.target_model)
        if models.ranks is None
        else models.ranks.target_pool(lambda: pool("target", models.target_model))
    )  # one per rank set
    return target, (pool("draft", models.draft_model) if models.draft_model is not None else None)


def capture_graphs(target: ModelRunner | None, draft: ModelRunner | None, k_max: int, prefill: bool = True) -> float:
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
    if getattr(draft, "reads_features", False) and draft.graphs is not None:  # a feature draft's call graphs
        seconds += draft.graphs.warm_up(max_query=k_max + 1, max_steps=k_max)
    elif draft is not None and draft.graphs is not None:  # None: pool-less draft
        seconds += draft.graphs.warm_up(("last", "draft"))  # "last" up to 9 tokens: short catch-ups
    return seconds


class Engine:
    def __init__(
        self,
        options: EngineOptions | None = None,
        observer: EngineObserver | None = None,
        models: Models | None = None,
        *,
        simulated_acceptance: float | None = None,
        detokenize: bool = True,
    ):
        """`detokenize=False`: outputs carry no text (a front end detokenizes, as the gateway does).
        `simulated_acceptance` is for benchmarks only (see LocalVerifyLane); it overrides
        options.simulated_acceptance (set by `verifypd serve --simulated-acceptance`; no RPC sets it)."""
        self.options = options or EngineOptions()
        if simulated_acceptance is None:
            simulated_acceptance = self.options.simulated_acceptance
        self.models = models or load_models(self.options)
        m = self.models
        self.codec = TextCodec(m.target.tokenizer)
        self.target_pool, self.draft_pool = make_pools(m, self.options)
        graphs = None if self.options.cuda_graphs else False
        buckets = self.options.graph_buckets
        eagle = isinstance(m.draft_model, EagleModel)
        # Before the target's graphs are captured: they must write the features too.
        features = attach_features(m.target_model, self.target_pool, m.draft_model.config) if eagle else None
        make_runner = m.ranks.runner if m.ranks is not None else ModelRunner  # rank 0 sends each forward to the others
        target_runner = make_runner(m.target_model, self.target_pool, graphs=graphs, buckets=buckets)
        common = dict(
            vocab_size=m.target.shape.vocab_size,
            max_context=m.target.shape.max_context,
            target_model=m.target.name,
            draft_model=m.draft_name,
        )
        pools = (self.target_pool.info(),) + ((self.draft_pool.info(),) if self.draft_pool else ())
        if m.draft_model is None:  # pool-less draft lane: built from its spec, no runner, no KV
            draft_runner = None
            self.draft_lane = poolless_draft_lane(draft_spec(m.draft_name), LaneInfo("draft", (), **common))
            if self.draft_lane is None:
                raise ModelLoadError(f"draft {m.draft_name!r} needs a draft model, and none was loaded")
        else:
            runner_class = EagleRunner if eagle else ModelRunner
            extra = (features,) if eagle else ()
            draft_runner = runner_class(m.draft_model, self.draft_pool, *extra, graphs=graphs, buckets=buckets)
            self.draft_lane = LocalDraftLane(draft_runner, LaneInfo("draft", pools[1:], reads_features=eagle, **common))
        self.startup_capture_seconds = capture_graphs(target_runner, draft_runner, self.options.config.k_max)
        if m.ranks is not None:
            m.ranks.wait_ready()  # the followers captured theirs too (a failed one ends this process)
        self.verify_lane = LocalVerifyLane(
            target_runner, LaneInfo("verify", (pools[0],), **common), simulated_acceptance=simulated_acceptance
        )
        decode_streams = (getattr(self.draft_lane, "stream", None), self.verify_lane.stream)
        self.prefill_lane = LocalPrefillLane(
            target_runner, draft_runner, LaneInfo("prefill", pools, **common), wait_for=decode_streams
        )
        self.router = Router(
            self.prefill_lane,
            self.draft_lane,
            self.verify_lane,
            decode=self.codec.decode if detokenize else None,
            eos_token_ids=m.target.eos_token_ids,
            config=self.options.config,
            max_running=self.options.max_running,
            observer=observer,
            lookup=LookupMix() if eagle and draft_spec(m.draft_name).lookup else None,
        )

    def generate(self, specs: list[RequestSpec]) -> dict[str, Completion]:
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
            self.elapsed_s = (
                out.stats.token_times[-1] if out.stats.token_times else time.monotonic()
            ) - out.stats.arrival_time
