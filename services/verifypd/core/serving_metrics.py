"""The serving SLO series of `/metrics` under vLLM's Prometheus names (`vllm:*`), so that vLLM's
community Grafana dashboards and alerts read a verifypd server unchanged; names in
`verifypd.domain.metric_names` (VLLM_*), every series documented in docs/services.md (Telemetry).

Why not OpenTelemetry instruments: OTel instrument names cannot hold a colon, and a histogram
per output token through the OTel SDK costs microseconds per call on the core's thread. Here a
histogram is a list of bucket counts (`Hist.observe`: one bisect and two adds, n tokens at once)
rendered by a prometheus_client collector when scraped.

Threads: every hook runs on the core loop's thread; `collect` runs on whichever thread answers
the scrape. Counts are plain ints and lists mutated under the GIL: a scrape sees each bucket
whole, and `_count` is derived from the buckets it read, so +Inf always equals the count.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from verifypd.domain import metric_names as mn
from verifypd.domain.requests import FinishReason
from verifypd.router.sequence import SeqStatus

# vLLM's buckets, with finer ones added below where speculative decoding's per-token gaps live.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ACCEPTANCE_BUCKETS = tuple(range(1, 17))  # tokens a verify step gave one request: accepted drafts + 1
SCAN_INTERVAL_S = 0.05  # gauges and in-flight token counts are refreshed at most this often

_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}  # vLLM's finished_reason values


class Hist:
    """A Prometheus histogram as bucket counts (upper bounds `buckets`, +Inf last) and a sum."""

    __slots__ = ("buckets", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (a step's tokens share one per-token gap)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.total += value * n

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        counts, acc, out = list(self.counts), 0, []
        for bound, c in zip((*(str(float(b)) for b in self.buckets), "+Inf"), counts, strict=True):
            acc += c
            out.append((bound, float(acc)))
        return out, self.total

    @property
    def count(self) -> int:
        return sum(self.counts)


def observe_itl(hist: Hist, token_times: list[float]) -> None:
    """Per-token inter-token latency from a request's emission times (one per token, equal within
    a step): each step's gap to the step before is spread evenly over the tokens it gave, one
    observation per token; the first step's tokens are TTFT's and have none."""
    n = len(token_times)
    i = 0
    while i < n and token_times[i] == token_times[0]:
        i += 1
    prev = token_times[0] if n else 0.0
    while i < n:
        t, j = token_times[i], i
        while j < n and token_times[j] == t:
            j += 1
        hist.observe((t - prev) / (j - i), j - i)
        prev, i = t, j


class ServingMetrics:
    """Per-request SLO histograms, scheduler gauges and token / preemption / speculation counters.
    The core's `Telemetry` forwards the router's observer hooks here; `collect` is a
    prometheus_client collector (register it on the registry /metrics renders)."""

    def __init__(self, model_name: str, clock: Callable[[], float] = time.monotonic):
        self.model_name, self.clock = model_name, clock
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.tpot = Hist(ITL_BUCKETS)  # per request: (last token - first) / (tokens - 1)
        self.e2e = Hist(REQUEST_BUCKETS)
        self.queue = Hist(REQUEST_BUCKETS)
        self.prefill = Hist(REQUEST_BUCKETS)
        self.decode = Hist(REQUEST_BUCKETS)
        self.inference = Hist(REQUEST_BUCKETS)
        self.prompt_len = Hist(TOKEN_BUCKETS)
        self.output_len = Hist(TOKEN_BUCKETS)
        self.acceptance = Hist(ACCEPTANCE_BUCKETS)
        self.finished: dict[str, int] = {}  # finished_reason -> requests
        # Counted when a request ends, plus what requests in flight hold (refreshed by the scan):
        # a long request's tokens show up while it runs, not all at its end.
        self.done_prompt = self.done_generation = self.done_preemptions = 0
        self.live_prompt = self.live_generation = self.live_preemptions = 0
        # What the last scan counted per request in flight: taken back out when it finishes, so a
        # finished request is never counted twice and the counters never go down.
        self._live: dict[str, tuple[int, int, int]] = {}
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.running = self.waiting = self.preempted = 0
        self.kv_usage = 0.0
        self.lane_restarts: Callable[[], int] | None = None  # the lane supervisor's count, when there is one
        self._scanned = -1.0

    # -- router hooks (core loop thread) -----------------------------------------------------
    def on_verify(self, k: int, accepted: int) -> None:
        if k:
            self.drafts += 1
            self.draft_tokens += k
            self.accepted_tokens += accepted
            # bucket `accepted + 1` (1..16) is index `accepted`; 16 is +Inf
            self.acceptance.counts[min(accepted, len(ACCEPTANCE_BUCKETS))] += 1
            self.acceptance.total += accepted + 1

    def on_request_finished(self, seq) -> None:
        s = seq.stats
        times = s.token_times
        reason = _REASONS.get(seq.finish_reason, "abort")
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.done_prompt += s.prompt_tokens
        self.done_generation += s.completion_tokens
        self.done_preemptions += s.preemptions
        scanned = self._live.pop(seq.request_id, None)
        if scanned is not None:
            self.live_prompt -= scanned[0]
            self.live_generation -= scanned[1]
            self.live_preemptions -= scanned[2]
        if s.scheduled_time is not None:
            self.queue.observe(s.scheduled_time - s.arrival_time)
        if not times or reason == "abort":
            return  # latency histograms describe requests that ran to their end, as vLLM's do
        first, last = times[0], times[-1]
        self.ttft.observe(first - s.arrival_time)
        self.e2e.observe(last - s.arrival_time)
        self.decode.observe(last - first)
        if s.scheduled_time is not None:
            self.prefill.observe(first - s.scheduled_time)
            self.inference.observe(last - s.scheduled_time)
        if len(times) > 1:
            self.tpot.observe((last - first) / (len(times) - 1))
            observe_itl(self.itl, times)
        self.prompt_len.observe(s.prompt_tokens)
        self.output_len.observe(s.completion_tokens)

    def on_step(self, router) -> None:
        now = self.clock()
        if now - self._scanned < SCAN_INTERVAL_S:
            return
        self._scanned = now
        self.scan(router)

    def scan(self, router) -> None:
        """Gauges and in-flight counts from the router's state (one pass over its requests)."""
        prompt = generation = preemptions = preempted = 0
        live = {}
        for seq in router.sequences():
            s = seq.stats
            live[seq.request_id] = (s.prompt_tokens, s.completion_tokens, s.preemptions)
            prompt += s.prompt_tokens
            generation += s.completion_tokens
            preemptions += s.preemptions
            preempted += s.preemptions > 0 and seq.status is SeqStatus.WAITING
        self._live = live
        self.live_prompt, self.live_generation, self.live_preemptions = prompt, generation, preemptions
        self.running, self.waiting, self.preempted = (
            len(router.scheduler.running),
            router.scheduler.num_waiting,
            preempted,
        )
        blocks = router.target_blocks
        self.kv_usage = blocks.num_used / blocks.num_blocks if blocks.num_blocks else 0.0

    # -- prometheus_client collector (scrape thread) -------------------------------------------
    def collect(self) -> Iterator:
        labels, values = ["model_name"], [self.model_name]

        def hist(name: str, doc: str, h: Hist) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=labels)
            buckets, total = h.cumulative()
            family.add_metric(values, buckets, sum_value=total)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield hist(mn.VLLM_TTFT, "Time to first token (arrival at the core to the first token), s", self.ttft)
        yield hist(
            mn.VLLM_ITL, "Inter-token latency, one observation per output token after the first step, s", self.itl
        )
        yield hist(mn.VLLM_TPOT_OLD, f"Same observations as {mn.VLLM_ITL} (vLLM's older name)", self.itl)
        yield hist(mn.VLLM_REQUEST_TPOT, "Per request: (last token - first token) / (output tokens - 1), s", self.tpot)
        yield hist(mn.VLLM_E2E, "Arrival at the core to the last token, s", self.e2e)
        yield hist(mn.VLLM_QUEUE, "Arrival to first admission to prefill, s", self.queue)
        yield hist(mn.VLLM_PREFILL, "First admission to the first token, s", self.prefill)
        yield hist(mn.VLLM_DECODE, "First token to the last, s", self.decode)
        yield hist(mn.VLLM_INFERENCE, "First admission to the last token, s", self.inference)
        yield hist(mn.VLLM_PROMPT_LEN, "Prompt tokens per finished request", self.prompt_len)
        yield hist(mn.VLLM_OUTPUT_LEN, "Output tokens per finished request", self.output_len)
        yield gauge(mn.VLLM_RUNNING, "Requests admitted (prefilling or decoding)", self.running)
        yield gauge(mn.VLLM_WAITING, "Requests waiting for admission (preempted ones included)", self.waiting)
        yield gauge(mn.PREEMPTED_WAITING, "Waiting requests that were preempted (to be recomputed)", self.preempted)
        yield gauge(mn.VLLM_KV_USAGE, "Share of the target KV pool's blocks in use (0-1)", self.kv_usage)
        yield gauge(mn.VLLM_KV_USAGE_OLD, f"Same as {mn.VLLM_KV_USAGE} (vLLM's older name)", self.kv_usage)
        prompt = self.done_prompt + self.live_prompt
        yield counter(mn.VLLM_PROMPT_TOKENS, "Prompt tokens of requests received", prompt)
        yield counter(mn.VLLM_GENERATION_TOKENS, "Output tokens generated", self.done_generation + self.live_generation)
        yield counter(mn.VLLM_PREEMPTIONS, "Preemptions (a request's KV freed, to be recomputed)",
                      self.done_preemptions + self.live_preemptions)  # fmt: skip
        success = CounterMetricFamily(
            mn.VLLM_REQUEST_SUCCESS, "Requests finished, by finished_reason", labels=[*labels, "finished_reason"]
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], self.finished.get(reason, 0))
        yield success
        yield counter(mn.VLLM_SPEC_DRAFTS, "Verify items that carried drafts", self.drafts)
        yield counter(mn.VLLM_SPEC_DRAFT_TOKENS, "Draft tokens verified", self.draft_tokens)
        yield counter(mn.VLLM_SPEC_ACCEPTED_TOKENS, "Draft tokens accepted", self.accepted_tokens)
        per_pos = CounterMetricFamily(
            mn.VLLM_SPEC_ACCEPTED_PER_POS, "Draft tokens accepted at each draft position", labels=[*labels, "position"]
        )
        counts = list(self.acceptance.counts)
        for pos in range(len(ACCEPTANCE_BUCKETS) - 1):  # position p accepted: items that accepted > p
            per_pos.add_metric([*values, str(pos)], sum(counts[pos + 1 :]))
        yield per_pos
        yield hist(
            mn.ACCEPTANCE_LENGTH, "Tokens one verify step gave one request (accepted drafts + 1)", self.acceptance
        )
        if self.lane_restarts is not None:
            yield counter(mn.LANE_RESTARTS, "Lane processes restarted by the supervisor", self.lane_restarts())
