"""From request records to the summary of one load point (definitions: docs/loadgen.md).

Inter-token latency is reported two ways, because accepted draft tokens arrive in bursts:
- per chunk: the gap between consecutive token-bearing messages. This is what vLLM's
  `bench serve` calls ITL (it timestamps each streamed chunk, whatever its token count).
- per token: each message's gap divided evenly over the tokens it carries, one sample per
  token. Its mean over a request is close to TPOT, which is what genai-perf reports as ITL
  ((e2e - ttft) / (output tokens - 1)); the per-token distribution keeps the spread.
Tokens of the first message are part of TTFT and have no ITL sample.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from verifypd_loadgen.runner import PointResult, RequestRecord

PERCENTILES = (50, 90, 95, 99)
STAT_KEYS = ("count", "mean", "std", "min", "max") + tuple(f"p{p}" for p in PERCENTILES)
LATENCY_METRICS = ("ttft", "itl_token", "itl_chunk", "tpot", "e2e")


def stats(values, scale: float = 1.0) -> dict:
    """count/mean/std/min/max and percentiles (numpy's linear interpolation) of values*scale;
    all but count are None when there are no values."""
    a = np.asarray(values, dtype=float) * scale
    if a.size == 0:
        return {k: (0 if k == "count" else None) for k in STAT_KEYS}
    out = {
        "count": int(a.size),
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    return out


@dataclass
class RequestTimes:
    """Per-request latencies in seconds (None where undefined)."""

    ttft: float | None
    tpot: float | None
    e2e: float
    itl_token: list[float]
    itl_chunk: list[float]


def request_times(rec: RequestRecord) -> RequestTimes:
    """The latencies of a finished request (`rec.end` set)."""
    if rec.end is None:
        raise ValueError(f"request {rec.request_id} has not finished")
    t = rec.chunk_times
    ttft = t[0] - rec.start if t else None
    chunk = [b - a for a, b in itertools.pairwise(t)]
    token = [g / n for g, n in zip(chunk, rec.chunk_tokens[1:], strict=True) for _ in range(n)]
    n_out = rec.output_tokens
    tpot = (t[-1] - t[0]) / (n_out - 1) if t and n_out > 1 else None
    return RequestTimes(ttft, tpot, rec.end - rec.start, token, chunk)


def meets_slo(times: RequestTimes, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    """The ITL SLO applies to the request's mean inter-token latency (TPOT), as vLLM's goodput
    does; a request with a single output token has no ITL and meets it."""
    if slo_ttft_ms is not None and (times.ttft is None or times.ttft * 1e3 > slo_ttft_ms):
        return False
    if slo_itl_ms is not None and times.tpot is not None and times.tpot * 1e3 > slo_itl_ms:
        return False
    return True


def samples(point: PointResult) -> dict[str, list[float]]:
    """Raw latency samples in ms of the successful requests (for CDF plots)."""
    out: dict[str, list[float]] = {m: [] for m in LATENCY_METRICS}
    for rec in point.records:
        if not rec.ok:
            continue
        times = request_times(rec)
        for m in ("ttft", "tpot", "e2e"):
            if getattr(times, m) is not None:
                out[m].append(getattr(times, m) * 1e3)
        out["itl_token"].extend(g * 1e3 for g in times.itl_token)
        out["itl_chunk"].extend(g * 1e3 for g in times.itl_chunk)
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def records(point: PointResult) -> list[dict]:
    """Per-request raw records (`--raw-records`), in send order; times in ms, `start_ms` from
    the point's first send. `itl_chunk_ms` are the gaps between token-bearing messages and
    `chunk_tokens` the tokens of each message (so ITL per token can be recomputed)."""
    out = []
    for rec in sorted(point.records, key=lambda r: r.start):
        times = request_times(rec) if rec.end is not None else None
        out.append(
            {
                "request_id": rec.request_id,
                "priority": rec.priority,
                "ok": rec.ok,
                "error": rec.error,
                "cancelled": rec.cancelled,
                "finish_reason": rec.finish_reason or None,
                "start_ms": (rec.start - point.t_start) * 1e3,
                "ttft_ms": _ms(times.ttft) if times else None,
                "tpot_ms": _ms(times.tpot) if times else None,
                "e2e_ms": _ms(times.e2e) if times else None,
                "itl_chunk_ms": [g * 1e3 for g in times.itl_chunk] if times else [],
                "chunk_tokens": list(rec.chunk_tokens),
                "output_tokens": rec.output_tokens,
                "prompt_tokens": rec.prompt_tokens or rec.input_len,
                "draft_tokens": rec.draft_tokens,
                "accepted_tokens": rec.accepted_tokens,
                "traceparent": rec.traceparent or None,
            }
        )
    return out


def summarize(point: PointResult, slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None) -> dict:
    recs = point.records
    ok = [r for r in recs if r.ok]
    cancelled = sum(r.cancelled for r in recs)
    errors = Counter(r.error for r in recs if r.error is not None and not r.cancelled)
    dur = point.duration
    s = samples(point)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.input_len or 0 for r in ok)
    use_slo = slo_ttft_ms is not None or slo_itl_ms is not None
    good = [r for r in ok if meets_slo(request_times(r), slo_ttft_ms, slo_itl_ms)]

    draft = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    steps = sum(r.verify_steps for r in ok)
    per_req_acc = [r.accepted_tokens / r.draft_tokens for r in ok if r.draft_tokens]
    applied_k = Counter(k for r in ok for k in r.applied_k)

    by_prio: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in ok:
        by_prio[r.priority].append(r)

    return {
        "duration_s": dur,
        "requests": {"sent": len(recs), "completed": len(ok), "failed": sum(errors.values()), "cancelled": cancelled},
        "errors": dict(sorted(errors.items())),
        "tokens": {
            "input_total": in_tokens,
            "output_total": out_tokens,
            "output_per_request": stats([r.output_tokens for r in ok]),
        },
        "throughput": {
            "requests_per_s": len(ok) / dur,
            "output_tokens_per_s": out_tokens / dur,
            "input_tokens_per_s": in_tokens / dur,
            "total_tokens_per_s": (in_tokens + out_tokens) / dur,
        },
        "goodput": {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_itl_ms": slo_itl_ms,
            "good_requests": len(good) if use_slo else None,
            "fraction": (len(good) / len(ok) if ok else 0.0) if use_slo else None,
            "requests_per_s": len(good) / dur if use_slo else None,
            "output_tokens_per_s": (sum(r.output_tokens for r in good) / dur if use_slo else None),
        },
        "latency_ms": {m: stats(s[m]) for m in LATENCY_METRICS},
        "speculation": {
            "draft_tokens": draft,
            "accepted_tokens": accepted,
            "verify_steps": steps,
            "acceptance_rate": accepted / draft if draft else None,
            "acceptance_rate_per_request": stats(per_req_acc),
            "tokens_per_verify_step": (sum(r.output_tokens for r in ok if r.verify_steps) / steps if steps else None),
            "tokens_per_chunk": stats([n for r in ok for n in r.chunk_tokens]),
            "applied_k": {str(k): v for k, v in sorted(applied_k.items())},
        },
        "client": {
            "procs": len(point.client_cpu),
            "cpu_util": [round(u, 3) for u in point.client_cpu],
            "cpu_util_max": round(max(point.client_cpu), 3) if point.client_cpu else None,
        },
        "by_priority": {
            str(p): {
                "completed": len(rs),
                "ttft_ms": stats([ttft * 1e3 for r in rs if (ttft := request_times(r).ttft) is not None]),
                "e2e_ms": stats([request_times(r).e2e * 1e3 for r in rs]),
            }
            for p, rs in sorted(by_prio.items())
        },
    }
