"""What to send: length distributions, synthetic prompts, priority mixes, request building."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from verifypd.v1 import generate_pb2

DIST_HELP = "N | fixed:N | uniform:LO,HI | normal:MEAN,STD | lognormal:MEAN,SIGMA"


@dataclass(frozen=True)
class Distribution:
    """A distribution of positive integer lengths; samples are rounded and clipped to >= 1."""

    kind: str
    params: tuple[float, ...]

    def sample(self, rng: np.random.Generator) -> int:
        value: float
        if self.kind == "fixed":
            value = self.params[0]
        elif self.kind == "uniform":
            value = int(rng.integers(int(self.params[0]), int(self.params[1]), endpoint=True))
        elif self.kind == "normal":
            value = rng.normal(self.params[0], self.params[1])
        else:  # lognormal, parameterised by its mean and the sigma of log(x)
            mean, sigma = self.params
            value = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma)
        return max(1, int(round(value)))

    @property
    def mean(self) -> float:
        return (sum(self.params) / 2) if self.kind == "uniform" else self.params[0]

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{p:g}" for p in self.params)


def parse_distribution(spec: str) -> Distribution:
    """Parses DIST_HELP syntax; raises ValueError with a message naming the problem."""
    kind, _, rest = spec.strip().partition(":")
    if not rest:
        kind, rest = "fixed", kind
    kind = kind.lower()
    arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
    if kind not in arity:
        raise ValueError(f"unknown distribution {kind!r} in {spec!r} (expected {DIST_HELP})")
    try:
        params = tuple(float(p) for p in rest.split(","))
    except ValueError:
        raise ValueError(f"non-numeric parameter in {spec!r} (expected {DIST_HELP})") from None
    if len(params) != arity[kind]:
        raise ValueError(f"{kind} takes {arity[kind]} parameter(s), got {spec!r}")
    if kind in ("fixed", "lognormal") and params[0] < 1:
        raise ValueError(f"mean length must be >= 1 in {spec!r}")
    if kind == "uniform" and not 1 <= params[0] <= params[1]:
        raise ValueError(f"uniform needs 1 <= LO <= HI, got {spec!r}")
    if kind in ("normal", "lognormal") and params[1] < 0:
        raise ValueError(f"spread must be >= 0 in {spec!r}")
    return Distribution(kind, params)


def parse_priority_mix(spec: str) -> list[tuple[int, float]]:
    """`P:W,P:W,...` -> [(priority, probability)]; weights are normalised."""
    pairs = []
    for item in spec.split(","):
        prio, sep, weight = item.partition(":")
        try:
            pairs.append((int(prio), float(weight) if sep else 1.0))
        except ValueError:
            raise ValueError(f"bad priority-mix entry {item!r} (expected PRIORITY:WEIGHT)") from None
    if any(not -100 <= p <= 100 for p, _ in pairs):
        raise ValueError("priorities must be in [-100, 100]")
    total = sum(w for _, w in pairs)
    if total <= 0 or any(w < 0 for _, w in pairs):
        raise ValueError("priority-mix weights must be >= 0 with a positive sum")
    return [(p, w / total) for p, w in pairs]


@dataclass
class Prompt:
    """One dataset entry: exactly one of token_ids / text / chat, and an optional length."""

    token_ids: list[int] | None = None
    text: str | None = None
    chat: list[tuple[str, str]] | None = None
    max_tokens: int | None = None


@dataclass
class RequestSpec:
    """A request to send (prompt + generation settings), before it gets its request id."""

    prompt: Prompt
    max_tokens: int
    priority: int = 0
    temperature: float = 0.0
    seed: int | None = None
    stop_at_eos: bool | None = None

    @property
    def input_len(self) -> int | None:
        return len(self.prompt.token_ids) if self.prompt.token_ids is not None else None

    def to_proto(self, request_id: str) -> generate_pb2.GenerateRequest:
        req = generate_pb2.GenerateRequest(request_id=request_id, max_tokens=self.max_tokens, priority=self.priority)
        if self.prompt.token_ids is not None:
            req.token_ids.ids.extend(self.prompt.token_ids)
        elif self.prompt.text is not None:
            req.text = self.prompt.text
        else:
            for role, content in self.prompt.chat or []:
                req.chat.messages.add(role=role, content=content)
        if self.temperature > 0:
            req.sampling.temperature = self.temperature
            if self.seed is not None:
                req.sampling.seed = self.seed
        if self.stop_at_eos is not None:
            req.stop_at_eos = self.stop_at_eos
        return req


@dataclass
class Workload:
    """An endless, seeded stream of RequestSpecs.

    With `prompts` None the prompts are synthetic token ids; otherwise the dataset entries are
    cycled through, reshuffled (seeded) on every pass. `output_len` overrides dataset lengths.
    """

    prompts: list[Prompt] | None = None
    input_len: Distribution = field(default_factory=lambda: Distribution("fixed", (128,)))
    output_len: Distribution | None = None
    vocab_range: tuple[int, int] = (100, 10000)
    temperature: float = 0.0
    priority_mix: list[tuple[int, float]] = field(default_factory=lambda: [(0, 1.0)])
    ignore_eos: bool = False
    seed: int = 0
    proc: int = 0  # --procs: the client process's index; each process draws its own requests
    # --workload mixed: this share of the synthetic requests get a prompt of `long_input_len`
    # tokens instead (long prefills arriving among streaming decodes)
    long_fraction: float = 0.0
    long_input_len: Distribution = field(default_factory=lambda: Distribution("fixed", (2048,)))

    DEFAULT_OUTPUT = Distribution("fixed", (128,))

    def requests(self, stream: int = 0) -> Iterator[RequestSpec]:
        """Stream `stream` of the workload: equal (seed, stream) give equal requests, so every
        sweep point sees the same requests; warm-up uses a different stream."""
        rng = np.random.default_rng([self.seed, stream] + ([self.proc] if self.proc else []))
        prios = np.array([p for p, _ in self.priority_mix])
        weights = np.array([w for _, w in self.priority_mix])
        order: list[int] = []
        while True:
            if self.prompts is None:
                long = self.long_fraction > 0 and rng.random() < self.long_fraction
                n = (self.long_input_len if long else self.input_len).sample(rng)
                ids = rng.integers(self.vocab_range[0], self.vocab_range[1], size=n)
                prompt = Prompt(token_ids=[int(i) for i in ids])
            else:
                if not order:
                    order = list(rng.permutation(len(self.prompts)))
                prompt = self.prompts[order.pop()]
            if self.output_len is not None:
                max_tokens = self.output_len.sample(rng)
            elif prompt.max_tokens is not None:
                max_tokens = prompt.max_tokens
            else:
                max_tokens = self.DEFAULT_OUTPUT.sample(rng)
            # Synthetic runs control the output length exactly; dataset runs stop at EOS unless
            # told otherwise, like a real client would.
            synthetic = self.prompts is None
            yield RequestSpec(
                prompt=prompt,
                max_tokens=max_tokens,
                priority=int(rng.choice(prios, p=weights)),
                temperature=self.temperature,
                seed=int(rng.integers(0, 2**63)),
                stop_at_eos=False if (synthetic or self.ignore_eos) else None,
            )
