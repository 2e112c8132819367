"""Request-level domain types shared by the router, the lanes and the front ends. Torch-free."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_K = 16  # hard upper bound on draft length (bounded per-step work and pool reservation)
# Temperatures below this are greedy: logits / 1e-45 overflow to inf and softmax gives NaN.
GREEDY_BELOW = 1e-5
# Stop strings are matched against the text after every step: bounded so one request cannot slow
# every other one down.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Sampling controls (domain.sampling_controls has their semantics): bounded so one request's
# per-step work stays small.
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the field and says what to fix.

    Front ends map it to gRPC INVALID_ARGUMENT / a CLI usage error.
    """


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached or the model's context is full
    EOS = "eos"  # end-of-sequence token produced
    STOP = "stop"  # a stop string appeared in the text
    CANCELLED = "cancelled"  # aborted by the client (cancel or deadline)


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy. top_p == 1 and top_k == 0 disable truncation.

    The controls after `seed` change the target's distribution at every position (penalties,
    min_tokens, logit_bias), end a request (stop_token_ids) or report it (logprobs); their
    semantics and order: domain.sampling_controls. All at their defaults = plain decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # report the emitted tokens' log-probabilities
    top_logprobs: int = 0  # and this many alternatives at each position (needs logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Penalties on: the logits depend on the tokens before each position."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def controlled(self) -> bool:
        """The target's logits are changed before the choice (penalties, min_tokens, logit_bias)."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)

    @property
    def plain(self) -> bool:
        """Neither controlled nor reporting logprobs: the lanes' fast paths apply."""
        return not self.controlled and not self.logprobs

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be in [0, 2^64), got {self.seed}")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and lo <= value <= hi):
                raise InvalidRequest(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequest(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                f"got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        seen: set[int] = set()
        for token, bias in self.logit_bias:
            if token in seen:
                raise InvalidRequest(f"logit_bias names token {token} twice")
            seen.add(token)
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidRequest(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: set logprobs too")

    def validate_vocab(self, vocab_size: int) -> None:
        """The token ids the controls name must be in the model's vocabulary."""
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise InvalidRequest(f"logit_bias: token id {token} is not in the vocabulary [0, {vocab_size})")
        for n, token in enumerate(self.stop_token_ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids[{n}]: token id {token} is not in the vocabulary [0, {vocab_size})"
                )


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target model (raw: before any sampling control
    or temperature, see domain.sampling_controls) and the `top` most likely tokens there, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# What a constraint says (structured output, verifypd.domain.grammar): "json" (any JSON object; text
# ignored), "json_schema" (text: the schema as JSON), "regex" (text: a regular expression the whole
# output matches), "grammar" (text: a Lark grammar in llguidance's dialect; %json embeds a schema).
CONSTRAINT_KINDS = ("json", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    kind: str
    text: str = ""
    field: str = "response_format"  # the request field it came from: named in errors


@dataclass(frozen=True)
class RequestSpec:
    """What a caller asks for, before tokenization checks against the model.

    `max_k` is the per-request speculation bound: None = server policy, 0 = plain decoding.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    max_k: int | None = None
    priority: int = 0
    request_id: str = ""
    constraint: Constraint | None = None  # structured output: the output follows this grammar

    @property
    def plain(self) -> bool:
        """No sampling controls, logprobs or constraint (`SamplingParams.plain`, no `constraint`): the
        lanes' fast paths apply and its steps may be launched ahead of the host (overlapped chains,
        speculate-ahead). Otherwise every step reads the tokens committed before it on the host
        (penalty counts, min_tokens, the grammar's masks), so none of its steps is launched ahead."""
        return self.sampling.plain and self.constraint is None

    def validate(self, *, vocab_size: int, max_context: int) -> None:
        if len(self.prompt_ids) == 0:
            raise InvalidRequest("prompt is empty: give at least one token or character")
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.prompt_ids) >= max_context:
            raise InvalidRequest(
                f"prompt has {len(self.prompt_ids)} tokens but the model's context is {max_context}: "
                f"shorten the prompt to at most {max_context - 1} tokens"
            )
        bad = [t for t in self.prompt_ids if not (0 <= t < vocab_size)]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
        self.sampling.validate()
        try:
            self.sampling.validate_vocab(vocab_size)
        except InvalidRequest as exc:  # the wire field (domain.convert names the others so)
            raise InvalidRequest(f"sampling.{exc}") from None
        if self.max_k is not None and not (0 <= self.max_k):
            raise InvalidRequest(f"k (max draft tokens) must be >= 0 (0 = no speculation), got {self.max_k}")
        if self.max_k is not None and self.max_k > MAX_K:
            raise InvalidRequest(f"k must be <= {MAX_K}, got {self.max_k}")
        if not (-100 <= self.priority <= 100):
            raise InvalidRequest(f"priority must be in [-100, 100], got {self.priority}")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for n, s in enumerate(self.stop):
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequest(f"stop[{n}]: {len(s)} characters; at most {MAX_STOP_CHARS}")


@dataclass
class RequestStats:
    """Per-request accounting, exposed as `usage` and used for telemetry."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # first admitted to prefill (queue time = this - arrival)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one emission time per output token
    preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def acceptance_rate(self) -> float | None:
        return None if self.draft_tokens == 0 else self.accepted_tokens / self.draft_tokens

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class RequestOutput:
    """What one router step produced for one request (a streaming chunk)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    applied_k: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked
