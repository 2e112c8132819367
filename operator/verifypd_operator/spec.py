"""The `VerifyPDConfig` spec as plain frozen dataclasses, with the CRD's defaults applied.

The API server applies the structural-schema defaults too; parsing them again here keeps the pure
functions (builders, decision) total on partial dicts (tests, objects written before a default
was added). Pure: no I/O, no Kubernetes client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verifypd.domain.defaults import (  # the CLI's own defaults
    DEFAULT_DRAFT,
    DEFAULT_K_INITIAL,
    DEFAULT_K_MAX,
    DEFAULT_K_MIN,
    DEFAULT_TARGET,
)

GROUP = "verifypd.dev"
VERSION = "v1alpha1"
PLURAL = "verifypdconfigs"
KIND = "VerifyPDConfig"
API_VERSION = f"{GROUP}/{VERSION}"

LANES = ("prefill", "draft", "verify")
# The scaling unit of the colocated topology: one pod holding gateway + all three lanes.
COLOCATED = "colocated"

# The router tokenizes and detokenizes; without requests its container would be BestEffort (the
# first evicted under node pressure). The CRD default and the parser's agree.
GATEWAY_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}}

GRPC_PORT = 50051
# The lanes' call channel (`verifypd lane --call-port`): a plain TCP port, the gateway's fast path
# for work calls. The lane announces it in Describe and the gateway dials <lane host>:<call port>,
# so in a pod it must be fixed (not 0 = any free port) and reachable, or the gateway falls back to
# the slower gRPC path. Split lane pods: on the pod IP, behind the lane Services and NetworkPolicy.
CALL_PORT = 50052
# The gateway's OpenAI-compatible HTTP API, /health and /metrics (`verifypd serve --http-port`).
HTTP_PORT = 8000
# Lane ports inside a colocated pod (containers share the pod's network namespace).
COLOCATED_LANE_PORTS = {"prefill": 50061, "draft": 50062, "verify": 50063}
# The lanes' call-channel ports inside a colocated pod (the gateway dials them on localhost).
COLOCATED_LANE_CALL_PORTS = {"prefill": 50071, "draft": 50072, "verify": 50073}


@dataclasses.dataclass(frozen=True)
class Replicas:
    replicas: int = 1
    min: int = 1
    max: int = 4
    gpu: int = 1
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tensor_parallel: int = 1  # the target's ranks (colocated, verify, prefill): `--tensor-parallel`


@dataclasses.dataclass(frozen=True)
class Speculation:
    k_initial: int = DEFAULT_K_INITIAL
    k_min: int = DEFAULT_K_MIN
    k_max: int = DEFAULT_K_MAX
    adaptive: bool = True


@dataclasses.dataclass(frozen=True)
class Priorities:
    draft: int = 2
    verify: int = 1
    prefill: int = 0


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_p95_ms: float = 1000.0
    itl_p95_ms: float = 100.0


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    enabled: bool = True
    interval_s: int = 30
    window_s: int = 120
    scale_up_cooldown_s: int = 60
    scale_down_cooldown_s: int = 300
    config_cooldown_s: int = 30
    breach_periods: int = 2  # consecutive breached evaluations before acting (anti-flap)
    headroom_periods: int = 3  # consecutive evaluations with headroom before relaxing
    headroom_ratio: float = 0.7  # "headroom" means every p95 below this fraction of its SLO
    min_samples: int = 20  # fewer observations in the window: hold
    # Newest telemetry older than this: hold (pods export every 5 s, pod_parts.otel_env).
    stale_after_s: int = 20


@dataclasses.dataclass(frozen=True)
class Spec:
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    quantization: str = "none"  # "none" | "fp8": the target's `--quantization`
    kv_cache_dtype: str = "auto"  # "auto" | "fp8": the KV pools' `--kv-cache-dtype`
    model_pvc: str | None = None  # PVC mounted read-only at /models (for local model dirs)
    image: str = "ghcr.io/verifypd/verifypd:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    topology: str = "colocated"
    gpu_sharing: str = "devicePlugin"  # colocated only: "devicePlugin" | "dra"
    dra_device_class: str = "gpu.nvidia.com"
    kv_transport: str = "auto"
    # colocated.laneDevices: lane -> index among the pod's GPUs (prefill/verify disaggregation in a pod)
    lane_devices: Mapping[str, int] = dataclasses.field(default_factory=dict)
    gateway: Replicas = Replicas(gpu=0, resources=GATEWAY_RESOURCES)
    colocated: Replicas = Replicas()
    lanes: Mapping[str, Replicas] = dataclasses.field(default_factory=lambda: {lane: Replicas() for lane in LANES})
    speculation: Speculation = Speculation()
    priorities: Priorities = Priorities()
    prefill_token_budget: int = 512
    prefill_token_budget_max: int = 4096
    slo: Slo = Slo()
    autoscaling: Autoscaling = Autoscaling()
    prometheus_scrape: bool = False  # annotate gateway pods for Prometheus scraping of /metrics

    def units(self) -> tuple[str, ...]:
        """The independently scaled Deployments' unit names for this topology."""
        return (COLOCATED,) if self.topology == COLOCATED else LANES

    def bounds(self, unit: str) -> Replicas:
        return self.colocated if unit == COLOCATED else self.lanes[unit]


def _replicas(d: Mapping[str, Any] | None, *, gpu: int = 1, resources: Mapping[str, Any] | None = None) -> Replicas:
    d = d or {}
    return Replicas(
        replicas=int(d.get("replicas", 1)),
        min=int(d.get("minReplicas", 1)),
        max=int(d.get("maxReplicas", 4)),
        gpu=int(d.get("gpu", gpu)),
        resources=dict(d["resources"] if "resources" in d else resources or {}),
        tensor_parallel=int(d.get("tensorParallel", 1)),
    )


def parse_spec(spec: Mapping[str, Any] | None) -> Spec:
    """Parse a CR's `.spec` dict; missing fields take the CRD defaults."""
    s = spec or {}
    model = s.get("model") or {}
    image = s.get("image") or {}
    spec_k = s.get("speculation") or {}
    prio = s.get("priorities") or {}
    slo = s.get("slo") or {}
    auto = s.get("autoscaling") or {}
    lanes = s.get("lanes") or {}
    colo = s.get("colocated") or {}
    metrics = s.get("metrics") or {}
    d = Spec()
    return Spec(
        target=model.get("target", d.target),
        draft=model.get("draft", d.draft),
        quantization=model.get("quantization", d.quantization),
        kv_cache_dtype=model.get("kvCacheDtype", d.kv_cache_dtype),
        model_pvc=model.get("pvcName") or None,
        image=f"{image.get('repository', 'ghcr.io/verifypd/verifypd')}:{image.get('tag', '0.1.0')}",
        image_pull_policy=image.get("pullPolicy", d.image_pull_policy),
        topology=s.get("topology", d.topology),
        gpu_sharing=colo.get("gpuSharing", d.gpu_sharing),
        dra_device_class=colo.get("draDeviceClass", d.dra_device_class),
        kv_transport=s.get("kvTransport", d.kv_transport),
        lane_devices={lane: int(n) for lane, n in (colo.get("laneDevices") or {}).items()},
        gateway=_replicas(s.get("gateway"), gpu=0, resources=GATEWAY_RESOURCES),
        colocated=_replicas(colo),
        lanes={lane: _replicas(lanes.get(lane)) for lane in LANES},
        speculation=Speculation(
            k_initial=int(spec_k.get("kInitial", d.speculation.k_initial)),
            k_min=int(spec_k.get("kMin", d.speculation.k_min)),
            k_max=int(spec_k.get("kMax", d.speculation.k_max)),
            adaptive=bool(spec_k.get("adaptive", d.speculation.adaptive)),
        ),
        priorities=Priorities(
            draft=int(prio.get("draft", d.priorities.draft)),
            verify=int(prio.get("verify", d.priorities.verify)),
            prefill=int(prio.get("prefill", d.priorities.prefill)),
        ),
        prefill_token_budget=int(s.get("prefillTokenBudget", d.prefill_token_budget)),
        prefill_token_budget_max=int(s.get("prefillTokenBudgetMax", d.prefill_token_budget_max)),
        slo=Slo(
            ttft_p95_ms=float(slo.get("ttftP95Ms", d.slo.ttft_p95_ms)),
            itl_p95_ms=float(slo.get("itlP95Ms", d.slo.itl_p95_ms)),
        ),
        autoscaling=Autoscaling(
            enabled=bool(auto.get("enabled", d.autoscaling.enabled)),
            interval_s=int(auto.get("intervalSeconds", d.autoscaling.interval_s)),
            window_s=int(auto.get("windowSeconds", d.autoscaling.window_s)),
            scale_up_cooldown_s=int(auto.get("scaleUpCooldownSeconds", d.autoscaling.scale_up_cooldown_s)),
            scale_down_cooldown_s=int(auto.get("scaleDownCooldownSeconds", d.autoscaling.scale_down_cooldown_s)),
            config_cooldown_s=int(auto.get("configCooldownSeconds", d.autoscaling.config_cooldown_s)),
            breach_periods=int(auto.get("breachPeriods", d.autoscaling.breach_periods)),
            headroom_periods=int(auto.get("headroomPeriods", d.autoscaling.headroom_periods)),
            headroom_ratio=float(auto.get("headroomRatio", d.autoscaling.headroom_ratio)),
            min_samples=int(auto.get("minSamples", d.autoscaling.min_samples)),
            stale_after_s=int(auto.get("staleAfterSeconds", d.autoscaling.stale_after_s)),
        ),
        prometheus_scrape=bool(metrics.get("prometheusScrape", d.prometheus_scrape)),
    )
