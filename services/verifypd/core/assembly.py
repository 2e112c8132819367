"""The one place that assembles an engine core's stack from resolved options.

    build_colocated(options) -> ColocatedStack   models, KV pools, in-process lanes and the router,
                                                 all in this process (the in-process engine,
                                                 verifypd.engine.Engine, is one of these)
    build_split(addrs, options) -> SplitStack    the router over gRPC lane clients; the prefill lane
                                                 imports (or stages) the owners' pools
    load_stack_models(options) -> Models         the models of a colocated stack: one process's, or
                                                 rank 0's of a target over --tensor-parallel ranks
    server_info(...)                             the ServerInfo the gateway answers with

The pieces come from the rooms below: model.build (devices, models, pools, graphs),
lanes.tensor_parallel.assembly (a sharded target), lanes.local / lanes.rpc (the lanes),
spec_decode (pool-less drafts, lookup mix) and router (the Router).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from verifypd import __version__
from verifypd.domain.grammar import GrammarCompiler
from verifypd.domain.lanes import LaneInfo, PoolInfo
from verifypd.domain.models import ModelLoadError, draft_spec
from verifypd.domain.options import EngineOptions
from verifypd.domain.tokenizer import TextCodec
from verifypd.router.router import EngineObserver, Router
from verifypd.v1 import generate_pb2

if TYPE_CHECKING:  # torch: imported by the builder only (the gateway imports this module)
    from verifypd.lanes.local import LocalPrefillLane
    from verifypd.lanes.local_verify import LocalVerifyLane
    from verifypd.lanes.rpc.lane_client import GrpcDraftLane, GrpcPrefillLane, GrpcVerifyLane
    from verifypd.model.build import Models
    from verifypd.model.eagle_draft import EagleRunner
    from verifypd.model.kv_pool import KvPool
    from verifypd.model.runner import ModelRunner
    from verifypd.net.lane_tls import LaneTls
    from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.core")


def server_info(
    target: str, draft: str, topology: str, max_context: int, sliding: tuple[int, str] = (0, "")
) -> generate_pb2.ServerInfo:
    """`sliding`: (sliding_window, sliding_window_kv) as ServerInfo documents them (sliding_fields)."""
    return generate_pb2.ServerInfo(
        target_model=target,
        draft_model=draft,
        topology=topology,
        max_context=max_context,
        version=__version__,
        sliding_window=sliding[0],
        sliding_window_kv=sliding[1],
    )


def sliding_fields(sliding_window: int | None, sliding_layers: tuple[int, ...], freed: bool) -> tuple[int, str]:
    """ServerInfo's (sliding_window, sliding_window_kv) of a target whose shape has these fields;
    `freed`: its KV pool releases the blocks behind the window (PoolInfo.window > 0)."""
    window = (sliding_window or 0) if sliding_layers else 0
    return window, ("" if not window else "freed" if freed else "kept")


# -- colocated: everything in this process -------------------------------------------------------
@dataclass
class ColocatedStack:
    options: EngineOptions
    models: Models
    codec: TextCodec
    target_pool: KvPool
    draft_pool: KvPool | None  # None: a pool-less draft
    prefill_lane: LocalPrefillLane
    draft_lane: object  # LocalDraftLane, or a pool-less draft lane (spec_decode.ngram)
    verify_lane: LocalVerifyLane
    router: Router
    startup_capture_seconds: float  # CUDA graphs captured before serving

    def info(self, topology: str = "colocated") -> generate_pb2.ServerInfo:
        s = self.models.target.shape
        sliding = sliding_fields(s.sliding_window, s.sliding_layers, self.target_pool.window > 0)
        return server_info(self.options.target, self.options.draft, topology, self.router.max_context, sliding)


def load_stack_models(options: EngineOptions) -> Models:
    """The models of a colocated stack: the whole target in this
    process, or rank 0's shard with the follower ranks started (--tensor-parallel > 1)."""
    if options.tensor_parallel != 1:
        from verifypd.lanes.tensor_parallel.assembly import load_tensor_parallel

        return load_tensor_parallel(options)
    from verifypd.model.build import load_models

    return load_models(options)


def build_colocated(
    options: EngineOptions,
    *,
    observer: EngineObserver | None = None,
    models: Models | None = None,
    simulated_acceptance: float | None = None,
    detokenize: bool = True,
) -> ColocatedStack:
    """Models (`models`, else loaded), pools, in-process lanes and the router. `detokenize=False`:
    outputs carry no text (a front end detokenizes, as the gateway does). `simulated_acceptance`
    (benchmarks only, see LocalVerifyLane) overrides options.simulated_acceptance."""
    from verifypd.lanes.local import LocalDraftLane, LocalPrefillLane
    from verifypd.lanes.local_verify import LocalVerifyLane
    from verifypd.model.build import capture_graphs, make_pools
    from verifypd.model.eagle_draft import EagleModel, EagleRunner, attach_features
    from verifypd.model.runner import ModelRunner
    from verifypd.spec_decode.lookup_mix import LookupMix
    from verifypd.spec_decode.ngram import poolless_draft_lane

    if simulated_acceptance is None:
        simulated_acceptance = options.simulated_acceptance
    m = models or load_stack_models(options)
    codec = TextCodec(m.target.tokenizer)
    target_pool, draft_pool = make_pools(m, options)
    graphs = None if options.cuda_graphs else False
    buckets = options.graph_buckets
    draft_model = m.draft_model
    eagle = isinstance(draft_model, EagleModel)
    # Before the target's graphs are captured: they must write the features too.
    features = (
        attach_features(m.target_model, target_pool, draft_model.config)
        if isinstance(draft_model, EagleModel)
        else None
    )
    make_runner = m.ranks.runner if m.ranks is not None else ModelRunner  # rank 0 sends each forward to the others
    target_runner = make_runner(m.target_model, target_pool, graphs=graphs, buckets=buckets)

    def lane_info(lane: str, pools: tuple[PoolInfo, ...], reads_features: bool = False) -> LaneInfo:
        return LaneInfo(
            lane,
            pools,
            vocab_size=m.target.shape.vocab_size,
            max_context=m.target.shape.max_context,
            target_model=m.target.name,
            draft_model=m.draft_name,
            reads_features=reads_features,
        )

    pools = (target_pool.info(),) + ((draft_pool.info(),) if draft_pool else ())
    draft_runner: ModelRunner | EagleRunner | None = None
    if draft_model is None:  # pool-less draft lane: built from its spec, no runner, no KV
        draft_lane = poolless_draft_lane(draft_spec(m.draft_name), lane_info("draft", ()))
        if draft_lane is None:
            raise ModelLoadError(f"draft {m.draft_name!r} needs a draft model, and none was loaded")
    else:
        if draft_pool is None:
            raise RuntimeError(f"draft {m.draft_name!r}: its model was loaded, but make_pools made no pool for it")
        if isinstance(draft_model, EagleModel):
            assert features is not None  # attached above for an EAGLE head
            draft_runner = EagleRunner(draft_model, draft_pool, features, graphs=graphs, buckets=buckets)
        else:
            draft_runner = ModelRunner(draft_model, draft_pool, graphs=graphs, buckets=buckets)
        draft_lane = LocalDraftLane(draft_runner, lane_info("draft", pools[1:], reads_features=eagle))
    capture_seconds = capture_graphs(target_runner, draft_runner, options.config.k_max)
    if m.ranks is not None:
        m.ranks.wait_ready()  # the followers captured theirs too (a failed one ends this process)
    verify_lane = LocalVerifyLane(
        target_runner, lane_info("verify", (pools[0],)), simulated_acceptance=simulated_acceptance
    )
    decode_streams = (getattr(draft_lane, "stream", None), verify_lane.stream)
    prefill_lane = LocalPrefillLane(target_runner, draft_runner, lane_info("prefill", pools), wait_for=decode_streams)
    router = Router(
        prefill_lane,
        draft_lane,
        verify_lane,
        decode=codec.decode if detokenize else None,
        eos_token_ids=m.target.eos_token_ids,
        config=options.config,
        max_running=options.max_running,
        observer=observer,
        lookup=LookupMix() if eagle and draft_spec(m.draft_name).lookup else None,
        grammar=GrammarCompiler(codec.tokenizer, m.target.shape.vocab_size, m.target.eos_token_ids)
        if codec.tokenizer is not None
        else None,
        prefix_cache=options.prefix_cache,
    )
    return ColocatedStack(
        options, m, codec, target_pool, draft_pool, prefill_lane, draft_lane, verify_lane, router, capture_seconds
    )


# -- split: the router over lane clients ---------------------------------------------------------
# The lane clients of a split stack, in this order.
SplitLanes: TypeAlias = "tuple[GrpcPrefillLane, GrpcDraftLane, GrpcVerifyLane]"


@dataclass
class SplitStack:
    router: Router
    lanes: SplitLanes
    wiring: lanes_pb2.ImportPoolsReply  # the prefill lane's (lanes.rpc.lane_wiring.wire_pools)
    info: generate_pb2.ServerInfo


def connect_lanes(
    addrs: dict[str, str],
    *,
    timeout_s: float = 60.0,
    ready_timeout_s: float = 120.0,
    secret: str | None = None,
    tls: LaneTls | None = None,
) -> SplitLanes:
    """Lane clients of the three lanes at `addrs`, each serving. `tls`: mutual TLS to every lane,
    or None (plaintext)."""
    from verifypd.lanes.rpc.lane_client import GrpcDraftLane, GrpcPrefillLane, GrpcVerifyLane

    lanes = (
        GrpcPrefillLane(addrs["prefill"], timeout_s, secret, tls=tls),
        GrpcDraftLane(addrs["draft"], timeout_s, secret, tls=tls),
        GrpcVerifyLane(addrs["verify"], timeout_s, secret, tls=tls),
    )
    for lane in lanes:
        lane.wait_ready(ready_timeout_s)
    return lanes


def build_split(
    addrs: dict[str, str],
    options: EngineOptions,
    *,
    kv_transport: str = "auto",
    observer: EngineObserver | None = None,
    lane_timeout_s: float = 60.0,
    topology: str = "split",
    lane_secret: str | None = None,
    lane_tls: LaneTls | None = None,
    ready_timeout_s: float = 120.0,
) -> SplitStack:
    """The router over gRPC lane clients; the prefill lane imports (or stages) the owners' pools
    once (and again after a lane restart: CoreServer re-wires). The router does not detokenize:
    the gateway does (decode=None)."""
    from verifypd.lanes.rpc.lane_wiring import shares_pools, wire_pools

    prefill, draft, verify = connect_lanes(
        addrs, timeout_s=lane_timeout_s, secret=lane_secret, tls=lane_tls, ready_timeout_s=ready_timeout_s
    )
    wiring = wire_pools(prefill, draft, verify, kv_transport)
    log.info("lanes wired: %s (import %.3f s)", dict(wiring.mode_by_pool), wiring.import_seconds)
    verify_info = verify.describe_pb()
    # The router allocates every block (one BlockManager per pool), so the lanes agree on which
    # blocks are cached as long as they read one pool: with every pool imported by handle, a cached
    # block's KV is in the memory the prefill lane attends over. The copy transport's prefill lane
    # attends over its own staging pools, which never see the KV the verify lane writes while
    # decoding: a cached block's KV may not be there, so caching stays off then.
    shared = shares_pools(wiring)
    caching = options.prefix_cache and shared
    if options.prefix_cache and not shared:
        log.info("prefix caching: off in the split topology without KV by handle (docs/engine.md 'Prefix caching')")
    router = Router(
        prefill,
        draft,
        verify,
        decode=None,
        eos_token_ids=tuple(verify_info.eos_token_ids),
        config=options.config,
        max_running=options.max_running,
        observer=observer,
        prefix_cache=caching,  # the router keeps it off where the lanes cannot (StepContext._prefix_cache)
    )
    freed = router.context.target_pool.window > 0  # the verify lane's pool descriptor says
    info = server_info(options.target, options.draft, topology, router.max_context, split_sliding(options, freed))
    return SplitStack(router, (prefill, draft, verify), wiring, info)


def split_sliding(options: EngineOptions, freed: bool) -> tuple[int, str]:
    """ServerInfo's sliding fields in the split topology: the window from the target's config (no
    weights; the lanes hold the model), `freed` from the target pool's descriptor (PoolInfo.window). A
    config this process cannot read (the lanes' host has the checkpoint) gives (0, ""), with a log line."""
    from verifypd.model.loader import target_shape

    try:
        shape = target_shape(options.target, options.max_context)
    except ModelLoadError as exc:
        log.warning("ServerInfo: sliding window unknown (%s)", exc)
        return 0, ""
    return sliding_fields(shape.sliding_window, shape.sliding_layers, freed)
