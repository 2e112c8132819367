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
    """temperature == 0 means greedy. top_p == 1 and top_k == 0 disable truncation."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be in [0, 2^64), got {self.seed}")


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
