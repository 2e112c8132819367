"""Resolved options, torch-free: what the command lines turn into before anything is built.

EngineOptions   models, pools and router config of one stack (the in-process engine, the
                engine core's colocated stack, a lane process)
CoreOptions     `verifypd serve` resolved for the engine-core process: the stack's options plus
                topology, lane addresses, lane security and the core's limits; it reaches that
                process as JSON on its stdin (`to_json` / `from_json`, no pickle)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from verifypd.domain.config import LanePriorities, RuntimeConfig
from verifypd.domain.defaults import DEFAULT_TARGET
from verifypd.domain.drafts import DEFAULT_DRAFT

# How KV moves from the prefill lane to the pools' owners (docs/services.md "KV transports"):
# handle (open the owner's pool: same device), peer (stage locally, copy each layer into the owner's
# pool mapped by CUDA IPC: another GPU of this host), direct (write straight into that mapped pool:
# no staging), copy (stream blocks over gRPC: any host), auto.
KV_TRANSPORTS = ("auto", "handle", "copy", "peer", "direct")
QUANTIZATIONS = ("fp8",)  # --quantization: how the target's weights are quantized while loading
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: auto = the model dtype; fp8 = float8_e4m3fn


@dataclass
class EngineOptions:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT  # see verifypd.domain.drafts: ngram[:MIN-MAX] | none | self:N | a model spec
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    # "fp8": the target's dense projections quantized to fp8 while loading (docs/engine.md "fp8");
    # None: as the checkpoint stores them (a published FP8 checkpoint is fp8 either way).
    quantization: str | None = None
    # The KV pools' element type (model.kv_quant): "auto" = the model dtype, "fp8" = float8_e4m3fn
    # (half the bytes of bf16 a token, so about twice the tokens in the same memory).
    kv_cache_dtype: str = "auto"
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
    # The ranks' all-reduce (lanes/tensor_parallel/all_reduce.py): "auto" (the custom one-shot /
    # two-shot kernel where the GPUs are peer-accessible, else NCCL) | "custom" | "nccl".
    tp_all_reduce: str = "auto"
    # Automatic prefix caching (docs/engine.md "Prefix caching"); `--no-prefix-cache` turns it off.
    # The split topology serves without it (its start-up log says so).
    prefix_cache: bool = True
    # split: a device per lane process (`--lane-devices`, lane -> "cuda:N" or "cpu"); a lane not
    # named runs on `device`.
    lane_devices: dict[str, str] = field(default_factory=dict)
    # A lane process: how many lane processes share its GPU, each sizing its KV pool to that share of
    # the free memory (`--device-lanes`; serve passes it from --lane-devices). 3: all of split's lanes.
    device_lanes: int = 3


@dataclass
class LaneTlsFiles:
    """`serve`'s --lane-tls-* files (mutual TLS to the lanes; all None: plaintext)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None

    def given(self) -> bool:
        return any((self.cert_file, self.key_file, self.ca_file, self.server_name))


@dataclass
class CoreOptions:
    """`verifypd serve` resolved for the engine-core process (verifypd.core.process): built and
    checked by the launch layer, sent to the core as JSON (`to_json`) on a pipe, never on argv."""

    engine: EngineOptions = field(default_factory=EngineOptions)
    topology: str = "colocated"  # "colocated" | "split" (the core starts the lanes unless lane_addrs)
    lane_addrs: dict[str, str] = field(default_factory=dict)  # lane -> HOST:PORT of running lanes; {}: none
    # The running lanes' shared secret (--lane-secret-file or its environment variable), resolved by
    # the launch layer; lanes the core starts get a fresh one instead.
    lane_secret: str | None = field(default=None, repr=False)
    lane_tls: LaneTlsFiles = field(default_factory=LaneTlsFiles)
    kv_transport: str = "auto"  # one of KV_TRANSPORTS
    lane_timeout_s: float = 60.0
    recovery_timeout_s: float = 120.0
    stall_timeout_s: float = 10.0  # a step running longer: health NOT_SERVING (requests wait)
    max_lane_restarts: int = 5
    max_queue: int = 256
    mps: str = "off"  # "auto" | "on" | "off"
    metrics: bool = False  # the gateway serves /metrics: keep this process's instruments' text
    model_name: str = ""  # --served-model-name: the model_name label of the vLLM-named series ("": the target)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CoreOptions:
        """The inverse of to_json (TypeError / ValueError / KeyError on a malformed document)."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("core options: expected a JSON object")
        return cls(
            **{k: v for k, v in d.items() if k not in ("engine", "lane_tls")},
            engine=engine_options_from_dict(d["engine"]),
            lane_tls=LaneTlsFiles(**d["lane_tls"]),
        )


def engine_options_from_dict(d: dict) -> EngineOptions:
    """EngineOptions from `dataclasses.asdict` of one, as JSON brings it back (lists for tuples)."""
    d = dict(d)
    config = dict(d.pop("config"))
    priorities = LanePriorities(**config.pop("priorities"))
    buckets = d.pop("graph_buckets")
    return EngineOptions(
        **d,
        config=RuntimeConfig(**config, priorities=priorities),
        graph_buckets=tuple(buckets) if buckets is not None else None,
    )
