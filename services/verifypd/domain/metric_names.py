"""The telemetry contract between the services (exporters) and the operator (OTLP receiver).

Torch-free and dependency-free so that the operator and loadgen can import it. Names follow the
OpenTelemetry GenAI semantic conventions where one exists (`gen_ai.server.*`); the rest are ours
(`verifypd.*`). Durations are histograms in seconds.
"""

# GenAI semantic conventions (server side).
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"  # histogram, s
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"  # histogram, s (inter-token latency)
REQUEST_DURATION = "gen_ai.server.request.duration"  # histogram, s
TOKEN_USAGE = "gen_ai.client.token.usage"  # histogram, {token}; attribute gen_ai.token.type

# verifypd's own.
LANE_QUEUE_DEPTH = "verifypd.lane.queue_depth"  # gauge, {request}; attribute verifypd.lane
LANE_STEP_DURATION = "verifypd.lane.step.duration"  # histogram, s; attribute verifypd.lane
DRAFT_TOKENS = "verifypd.speculation.draft_tokens"  # counter, {token}
ACCEPTED_TOKENS = "verifypd.speculation.accepted_tokens"  # counter, {token}
ACCEPTANCE_RATE = "verifypd.speculation.acceptance_rate"  # gauge, ratio over the last window
APPLIED_K = "verifypd.speculation.applied_k"  # histogram, {token}: each distinct k a verify step used
KV_BLOCKS_IN_USE = "verifypd.kv.blocks_in_use"  # gauge, {block}; attribute verifypd.pool
# Verify steps launched before the previous step's results reached the host (engine.overlap), by
# whether they carried a prefill of admitted requests; ÷ the verify lane's call count = the share
# of chained steps. Prometheus: verifypd_engine_chained_steps_total{verifypd_step_prefill=...}.
CHAINED_STEPS = "verifypd.engine.chained_steps"  # counter, {step}; attribute verifypd.step.prefill
# `--draft eagle+ngram:`: requests' verify steps whose drafts were prompt lookup's, not the head's
# (engine.lookup_mix); ÷ verify steps that drafted = the share lookup took.
LOOKUP_PROPOSALS = "verifypd.speculation.lookup_proposals"  # counter, {step}
# Feature drafts (engine.draft_after): requests whose next drafts were launched right after their verify
# call, fitted to its verdict on the device; ÷ verify steps that drafted = the share made so.
DRAFTS_AFTER_VERIFY = "verifypd.speculation.drafts_after_verify"  # counter, {request}
# Speculative steps launched before the previous step's tokens were streamed (engine.spec_ahead).
STEPS_AHEAD = "verifypd.engine.speculative_steps_ahead"  # counter, {step}
# Of those, steps whose verify call was launched before the verdict of the one before it reached the host,
# laid out for its longest outcome and fitted on the device (engine.spec_ahead.fit_next).
VERIFY_FITTED = "verifypd.engine.verify_calls_fitted"  # counter, {step}

# Prometheus-only series of `/metrics` under vLLM's names, so vLLM's Grafana dashboards and alerts
# read verifypd unchanged (core/serving_metrics.py; label model_name). OTel instrument names cannot
# hold a colon: these never go over OTLP, where the GenAI names above carry the same quantities.
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"  # per output token
VLLM_TPOT_OLD = "vllm:time_per_output_token_seconds"  # vLLM's older name of the same series
VLLM_REQUEST_TPOT = "vllm:request_time_per_output_token_seconds"  # per request
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_PREFILL = "vllm:request_prefill_time_seconds"
VLLM_DECODE = "vllm:request_decode_time_seconds"
VLLM_INFERENCE = "vllm:request_inference_time_seconds"
VLLM_PROMPT_LEN = "vllm:request_prompt_tokens"
VLLM_OUTPUT_LEN = "vllm:request_generation_tokens"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # 0-1, as vLLM's
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"  # counter: rendered with _total
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_PREEMPTIONS = "vllm:num_preemptions"
VLLM_REQUEST_SUCCESS = "vllm:request_success"  # label finished_reason: stop | length | abort
VLLM_SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
VLLM_SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # label position
# Ours, Prometheus-only, beside them.
PREEMPTED_WAITING = "verifypd_num_requests_preempted"  # gauge
ACCEPTANCE_LENGTH = "verifypd_spec_decode_acceptance_length"  # histogram, tokens per verify item
LANE_RESTARTS = "verifypd_lane_restarts"  # counter
REQUEST_ERRORS = "verifypd_request_errors"  # counter (gateway); labels api, code

# Attribute keys.
ATTR_LANE = "verifypd.lane"  # "prefill" | "draft" | "verify"
ATTR_POOL = "verifypd.pool"  # "target" | "draft"
ATTR_TOKEN_TYPE = "gen_ai.token.type"  # "input" | "output"
ATTR_STEP_PREFILL = "verifypd.step.prefill"  # "true" | "false"

# Resource attributes the operator sets (through OTEL_RESOURCE_ATTRIBUTES) on every pod it runs;
# the receiver counts only metrics whose resource names a config it manages.
RES_CONFIG_NAME = "verifypd.config.name"
RES_CONFIG_NAMESPACE = "k8s.namespace.name"
RES_POD_NAME = "k8s.pod.name"

LANES = ("prefill", "draft", "verify")
