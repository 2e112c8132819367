"""One lane process: `verifypd lane prefill|draft|verify --port P --target M --draft M`.

No request logic here: each server wraps the in-process lane (verifypd.lanes.local) over runners
whose pools are the ones this process owns or imported, and converts messages at the edge.

    draft lane   owns the draft pool (+ draft weights); serves KvTransfer for it. A pool-less
                 draft (ngram, none) loads no model and owns no pool: it needs no GPU
    verify lane  owns the target pool (+ target weights); serves KvTransfer for it
    prefill lane has both models; after ImportPools (pool_import.py) it writes into the owners'
                 pools directly (imported: /dev/shm on CPU, CUDA IPC on GPU) or into local staging
                 pools whose touched blocks it then streams to the owners (copy transport) or
                 copies into the owners' pools on another GPU, layer by layer (peer transport,
                 peer_copy.py), or writes straight into the owners' pools mapped from another GPU
                 (direct)

One lock per process serializes work calls (and KvTransfer writes) on the pools.

Every request is validated at the edge (lane_validate.py) before it reaches the model code:
bad input is INVALID_ARGUMENT naming the field, a stale handle (pool or generation this lane
does not hold) FAILED_PRECONDITION, an empty batch a no-op; INTERNAL is left for real faults.
Owned pools get a generation that differs for every start of the lane (milliseconds since the
epoch), so handles allocated before a restart are refused even where pool ids could repeat.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

import grpc
import torch

from verifypd.domain.lanes import (
    DraftItem,
    DraftLane,
    DraftOutput,
    LaneInfo,
    PoolInfo,
    PrefillItem,
    PrefillOutput,
    VerifyItem,
    VerifyOutput,
)
from verifypd.domain.models import draft_spec
from verifypd.domain.options import EngineOptions
from verifypd.lanes.local import LocalDraftLane, LocalPrefillLane
from verifypd.lanes.local_verify import LocalVerifyLane
from verifypd.lanes.rpc import kv_transport as kv
from verifypd.lanes.rpc import lane_convert as lc
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc import peer_copy
from verifypd.lanes.rpc import pool_import as pi
from verifypd.lanes.rpc.call_channel import CallServer
from verifypd.lanes.rpc.lane_calls import CallChannelWork
from verifypd.lanes.rpc.lane_setup import load_lane_models, owned_pool, start_lane_ranks
from verifypd.lanes.rpc.lane_spans import end_call_span
from verifypd.model.build import capture_graphs
from verifypd.model.kv_pool import KvPool
from verifypd.model.llama import PagedLlama
from verifypd.model.runner import ModelRunner
from verifypd.spec_decode.ngram import poolless_draft_lane
from verifypd.v1 import lanes_pb2

if TYPE_CHECKING:
    from verifypd.lanes.tensor_parallel.ranks import LeaderRanks

log = logging.getLogger("verifypd.lane")
LANES = ("prefill", "draft", "verify")
T = TypeVar("T")
WorkBatch = lanes_pb2.PrefillBatch | lanes_pb2.DraftBatch | lanes_pb2.VerifyBatch  # a work RPC's request


class RpcContext(Protocol):
    """What the RPCs use of their grpc.ServicerContext: `abort` raises (it never returns)."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn: ...

    def invocation_metadata(self): ...  # (key, value) pairs: the lane secret, a traceparent


class LaneServicer(CallChannelWork):
    """Implements Describe / ImportPools and the lane's work RPC (Prefill, Draft or Verify)."""

    def __init__(self, role: str, options: EngineOptions, secret: str | None = None, tls=None):
        """`tls`: a verifypd.net.lane_tls.LaneTls: every port of this lane speaks mutual TLS only, and
        its KV pushes present the same certificate. None: plaintext (the lane secret still applies)."""
        if role not in LANES:
            raise ValueError(f"lane must be one of {', '.join(LANES)}; got {role!r}")
        self.role, self.options, self.secret, self.tls = role, options, secret, tls
        self.generation = time.time_ns() // 1_000_000  # new for every start of this lane
        self.lock = threading.Lock()
        target, self.target_model, self.draft_model, self.device, self.dtype, self.kv_dtype = load_lane_models(
            options, need_target=role in ("prefill", "verify"), need_draft=role in ("prefill", "draft")
        )
        model = self.target_model or self.draft_model
        # 0 = not this lane's to say (a pool-less draft lane loads no model); the router takes both
        # from the verify lane.
        self.vocab_size, self.max_context = (model.shape.vocab_size, model.shape.max_context) if model else (0, 0)
        self.eos_token_ids = target.eos_token_ids if target else ()
        self.owned: dict[str, KvPool] = {}
        # The lane the work calls run on, by role (the prefill lane's once ImportPools wired it).
        self.prefill_lane: LocalPrefillLane | None = None
        self.draft_lane: DraftLane | None = None
        self.verify_lane: LocalVerifyLane | None = None
        # --tensor-parallel N (verify, prefill): this process is rank 0 of the target (lanes/tensor_parallel/ranks.py).
        self.ranks: LeaderRanks | None = None
        self.rank_shards: list[lanes_pb2.PoolDescriptor] = []
        if options.tensor_parallel != 1 and self.target_model is not None:
            self.ranks = start_lane_ranks(role, options, self.target_model, self.device, self.dtype, self.generation)
        if role == "verify":
            target_model = self._loaded(self.target_model, "target")
            pool = owned_pool(
                "target", target_model, options, self.device, self.kv_dtype, self.generation, ranks=self.ranks
            )
            self.owned[pool.pool_id] = pool
            runner = self._runner(target_model, pool)
            # At start-up, not inside the first calls; no prefill graphs: this lane prefills nothing.
            capture_graphs(runner, None, options.config.k_max, prefill=False)
            if self.ranks is not None:  # the other ranks' pools, for the prefill lane's ranks to open
                self.rank_shards = [lanes_pb2.PoolDescriptor.FromString(b) for b in self.ranks.wait_ready()]
            self.verify_lane = LocalVerifyLane(
                runner, self._info((pool.info(),)), simulated_acceptance=options.simulated_acceptance
            )
        elif role == "draft" and self.draft_model is None:
            self.draft_lane = poolless_draft_lane(draft_spec(options.draft), self._info(()))
        elif role == "draft":
            draft_model = self._loaded(self.draft_model, "draft")
            pool = owned_pool("draft", draft_model, options, self.device, self.kv_dtype, self.generation)
            self.owned[pool.pool_id] = pool
            runner = self._runner(draft_model, pool)
            capture_graphs(None, runner, options.config.k_max, prefill=False)
            self.draft_lane = LocalDraftLane(runner, self._info((pool.info(),)))
            if self.device.type == "cuda":
                from verifypd.lanes.rpc.draft_handoff import DraftHandoffBuffer

                self.handoff = DraftHandoffBuffer(self.device)
        elif self.ranks is not None:  # prefill: its followers have loaded their shards
            self.ranks.wait_ready()
        self.transfer = kv.KvTransferServicer(self.owned, self.lock)
        self.pushers: dict[str, kv.KvPusher] = {}  # role -> copy transport to the owner
        self.peers: dict[str, peer_copy.PeerCopier] = {}  # role -> peer transport to the owner
        self.pools: dict[str, KvPool] = {p.role: p for p in self.owned.values()}  # role -> pool handles name
        self.kv_bytes_copied = 0
        self.import_seconds = 0.0
        self.call_server: CallServer | None = None  # started by build_lane_server (lane_ports.py)
        # Prefill on CUDA with imported pools: recorded after writing KV, waited on by the owners
        # (instead of a device-wide synchronize before every reply). Owners: opened IPC events.
        self.kv_written: torch.cuda.Event | None = None
        self.peer_events: dict[bytes, torch.cuda.Event] = {}

    @property
    def lane(self) -> LocalPrefillLane | DraftLane | LocalVerifyLane | None:
        """The lane the work calls run on; None: the prefill lane before ImportPools (or closed)."""
        if self.prefill_lane is not None:
            return self.prefill_lane
        return self.draft_lane if self.draft_lane is not None else self.verify_lane

    def _loaded(self, model: PagedLlama | None, role: str) -> PagedLlama:
        if model is None:
            raise RuntimeError(f"the {self.role} lane loaded no {role} model")
        return model

    def _runner(self, model: PagedLlama, pool: KvPool) -> ModelRunner:
        make = self.ranks.runner if self.ranks is not None and model is self.target_model else ModelRunner
        return make(model, pool, graphs=None if self.options.cuda_graphs else False, buckets=self.options.graph_buckets)

    def _info(self, pools: Iterable[PoolInfo]) -> LaneInfo:
        return LaneInfo(
            self.role,
            tuple(pools),
            self.vocab_size,
            self.max_context,
            target_model=self.options.target,
            draft_model=self.options.draft,
        )

    def close(self) -> None:
        if self.call_server is not None:
            self.call_server.close()
        with self.lock:
            self.prefill_lane = self.draft_lane = self.verify_lane = None
            self.pushers, self.peers = {}, {}
        kv.release_imported()
        peer_copy.release_mapped()
        gc.collect()  # the imported storages go now, not at interpreter teardown
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for pool in self.owned.values():
            pool.close()
        if self.ranks is not None:
            self.ranks.close()

    # -- RPCs ------------------------------------------------------------------------------
    def Describe(self, request, context) -> lanes_pb2.LaneInfo:
        return lanes_pb2.LaneInfo(
            lane=self.role,
            target_model=self.options.target,
            draft_model=self.options.draft,
            pools=[self._describe(p) for p in self.owned.values()],
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_ids=self.eos_token_ids,
            kv_bytes_received=self.transfer.bytes_received,
            call_port=self.call_server.port if self.call_server is not None else 0,
            draft_handoff=self.handoff.describe() if self.handoff is not None else None,
            feeds_tokens=self.feeds_tokens,
        )

    def _describe(self, pool: KvPool) -> lanes_pb2.PoolDescriptor:
        d = kv.describe_pool(pool)
        if pool.role == "target":
            d.rank_shards.extend(self.rank_shards)
        return d

    def ImportPools(self, request: lanes_pb2.ImportPoolsRequest, context: RpcContext) -> lanes_pb2.ImportPoolsReply:
        with self.on_device():  # its events, streams and mappings belong to this lane's GPU
            return self._import_pools(request, context)

    def _import_pools(self, request: lanes_pb2.ImportPoolsRequest, context: RpcContext) -> lanes_pb2.ImportPoolsReply:
        if self.role == "verify" and request.HasField("draft_handoff") and not request.pools:
            return self._open_handoff(request.draft_handoff, context)
        if self.role != "prefill":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the {self.role} lane imports no pools")
        t0 = time.perf_counter()
        models = {"target": self._loaded(self.target_model, "target")}
        if self.draft_model is not None:
            models["draft"] = self.draft_model
        try:
            opened = pi.open_pools(
                request, models, self.options, self.device, self.kv_dtype, self.ranks, self.secret, self.tls
            )
        except lv.LaneInvalid as exc:
            context.abort(exc.code, str(exc))
        pools, pushers, peers, modes = opened.pools, opened.pushers, opened.peers, opened.modes
        target_runner = self._runner(models["target"], pools["target"])
        draft_runner = self._runner(self.draft_model, pools["draft"]) if self.draft_model is not None else None
        event = None
        # Not with ranks: the others' KV writes are ordered by rank 0's device sync (its last all-reduce
        # waits for them), not by an event on rank 0's device.
        # Nor with peer copies or direct writes: the owners run on other GPUs, so the lane synchronizes
        # its device instead.
        if (
            request.forward_kv_written_event
            and self.device.type == "cuda"
            and "imported" in modes.values()
            and not peer_copy.DEVICE_SYNCED & set(modes.values())
            and self.ranks is None
        ):
            event = torch.cuda.Event(interprocess=True)
        with self.lock:
            self.prefill_lane = LocalPrefillLane(target_runner, draft_runner, self._info(()))
            self.pushers, self.peers = pushers, peers
            self.pools = dict(pools)
            self.kv_written = event
            self.import_seconds = time.perf_counter() - t0
            # The forward announces each layer's K/V to its pool's copier (none: no peer transport;
            # a re-wiring drops the old copiers' hooks with them).
            for role, model in (("target", self.target_model), ("draft", self.draft_model)):
                if model is not None:
                    model.after_layer_kv = peers[role].layer_written if role in peers else None
        if "copy" in modes.values():
            nixl = "installed, not used" if peer_copy.nixl_available() else "not installed"
            log.info("KV to other hosts goes over the gRPC copy stream (NIXL %s)", nixl)
        log.info("prefill lane wired: %s in %.3f s", modes, self.import_seconds)
        return lanes_pb2.ImportPoolsReply(
            mode_by_pool=modes,
            import_seconds=self.import_seconds,
            kv_written_event=bytes(event.ipc_handle()) if event else b"",
        )

    def _open_handoff(self, d: lanes_pb2.DraftHandoff, context: RpcContext) -> lanes_pb2.ImportPoolsReply:
        t0 = time.perf_counter()
        try:
            opened = pi.open_handoff(d, self.device)
        except lv.LaneInvalid as exc:
            context.abort(exc.code, str(exc))
        with self.lock:
            self.opened_handoff = opened
        return lanes_pb2.ImportPoolsReply(
            mode_by_pool={"draft_handoff": "imported"}, import_seconds=time.perf_counter() - t0
        )

    def limits(self) -> lv.LaneLimits:
        pools = {
            role: lv.PoolLimits(p.pool_id, p.generation, p.geometry.num_blocks, p.geometry.block_size)
            for role, p in self.pools.items()
        }
        return lv.LaneLimits(self.vocab_size, self.max_context, pools)

    def _check(
        self, context: RpcContext, check: Callable[[WorkBatch, lv.LaneLimits], None], request: WorkBatch
    ) -> bool:
        """Validates a work batch; False for an empty batch (a no-op). Aborts on bad input."""
        if self.lane is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "prefill lane has no pools yet: call ImportPools")
        try:
            check(request, self.limits())
        except lv.LaneInvalid as exc:
            context.abort(exc.code, str(exc))
        return len(request.items) > 0

    def _run(self, context: RpcContext, fn: Callable[[], T], items: list) -> T:
        # Input was validated: whatever fails now is a fault of this lane (INTERNAL, logged with
        # its traceback here, never sent to the caller).
        span = self.spans.start(context.invocation_metadata() or (), items) if self.spans is not None else None
        error = None
        try:
            with self.lock, self.on_device():
                return fn()
        except Exception as exc:
            log.exception("%s lane call failed", self.role)
            error = f"{self.role} lane: internal error: {type(exc).__name__}: {exc}"
            context.abort(grpc.StatusCode.INTERNAL, error)
        finally:
            if span is not None:
                end_call_span(span, error)

    # -- the work, shared by unary RPCs and the call channel ----------------------------------
    def prefill_work(self, items: list[PrefillItem]) -> tuple[list[PrefillOutput], int]:
        if self.prefill_lane is None:
            raise RuntimeError(f"the {self.role} lane runs no prefill (a prefill lane: call ImportPools first)")
        for role, copier in self.peers.items():
            copier.begin(kv.prefill_blocks(items, role, copier.staging.geometry.block_size))
        try:
            outputs = self.prefill_lane.prefill(items)
        finally:  # orders this stream after the copies even when the forward failed
            copied = sum(copier.finish() for copier in self.peers.values())
        for role, pusher in self.pushers.items():
            copied += pusher.push(kv.prefill_blocks(items, role, pusher.pool.geometry.block_size))
        # IPC shares memory, not ordering: the owners' streams wait on kv_written (the router
        # forwards it), else the device finishes before we reply.
        if self.kv_written is not None:
            self.kv_written.record()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for copier in self.peers.values():
            copier.collect()  # one log line per transfer (logger verifypd.lane.kv)
        self.kv_bytes_copied += copied
        return outputs, copied

    def draft_work(self, items: list[DraftItem]) -> list[DraftOutput]:
        if self.draft_lane is None:
            raise RuntimeError(f"the {self.role} lane runs no draft calls")
        return self.draft_lane.draft(items)

    def verify_work(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        return self.verify_start(items).result()  # (CallChannelWork.verify_start)

    def Prefill(self, request: lanes_pb2.PrefillBatch, context: RpcContext) -> lanes_pb2.PrefillResult:
        if not self._check(context, lv.check_prefill, request):
            return lanes_pb2.PrefillResult()
        items = lc.prefill_batch_from_pb(request)
        outputs, copied = self._run(context, lambda: self.prefill_work(items), items)
        return lc.prefill_outputs_to_pb(outputs, copied)

    def Draft(self, request: lanes_pb2.DraftBatch, context: RpcContext) -> lanes_pb2.DraftResult:
        if not self._check(context, lv.check_draft, request):
            return lanes_pb2.DraftResult()
        items = lc.draft_batch_from_pb(request)
        top_ks = [i.sampling.top_k for i in items]
        return self._run(
            context, lambda: lc.draft_outputs_to_pb(self.draft_work(items), kv.encode_probs, top_ks), items
        )

    def Verify(self, request: lanes_pb2.VerifyBatch, context: RpcContext) -> lanes_pb2.VerifyResult:
        if not self._check(context, lv.check_verify, request):
            return lanes_pb2.VerifyResult()
        items = lc.verify_batch_from_pb(request, lambda d: d)
        return self._run(context, lambda: lc.verify_outputs_to_pb(self.verify_work(items)), items)
