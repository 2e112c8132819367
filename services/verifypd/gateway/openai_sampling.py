"""OpenAI's sampling controls, logprobs and n / best_of <-> the public GenerateRequest. Torch-free.

Parsing checks shape only (types, which endpoint takes what); ranges are the engine's
(`SamplingParams.validate`), whose messages name the field (`sampling.logit_bias ...`), mapped
back to the OpenAI parameter by openai_convert.openai_param. Semantics: domain.sampling_controls.

n / best_of: the gateway submits best_of (default n) requests of one prompt, sample i seeded with
`sample_seed(seed, i)` (domain.sampling_controls); with best_of > n the n of highest cumulative
logprob are returned (vLLM's rule), in that order. Each sample is its own sequence in the engine;
samples 1.. share sample 0's prompt KV through the prefix cache (gateway.samples).
"""

from __future__ import annotations

from dataclasses import dataclass

from verifypd.domain.requests import MAX_TOP_LOGPROBS, TokenLogprob
from verifypd.gateway.errors import bad
from verifypd.gateway.samples import MAX_SAMPLES  # 400 naming n / best_of above it
from verifypd.v1 import generate_pb2

# Parameters this module reads (openai_convert accepts them on both endpoints).
PARAMS = {
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "best_of",
}


@dataclass
class Samples:
    """How many samples a request asks for and returns; whether it wants logprobs reported."""

    n: int = 1
    best_of: int = 1
    report_logprobs: bool = False
    top_logprobs: int = 0


def parse(body: dict, chat: bool, req: generate_pb2.GenerateRequest, get, integer, number, stream: bool) -> Samples:
    """The controls of `body` into req.sampling; n / best_of and the logprobs to report.
    `get`, `integer`, `number`: openai_convert's typed getters (errors: gateway.errors.bad)."""
    s = req.sampling
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = number(body, name)
        if value is not None:
            setattr(s, name, value)
    min_tokens = integer(body, "min_tokens", 0, 2**32)
    if min_tokens is not None:
        s.min_tokens = min_tokens
    bias = get(body, "logit_bias", (dict,), 'an object {"token id": bias}')
    for key, value in (bias or {}).items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < 2**32):
            raise bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {key!r:.40}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"logit_bias[{key}] must be a number, got {value!r:.40}")
        s.logit_bias[int(key)] = float(value)
    stop_ids = get(body, "stop_token_ids", (list,), "a list of token ids")
    if stop_ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_ids):
            raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative token ids")
        s.stop_token_ids.extend(stop_ids)
    out = Samples()
    if chat:  # logprobs: bool, top_logprobs: 0..20 (needs logprobs)
        out.report_logprobs = bool(get(body, "logprobs", (bool,), "a boolean"))
        top = integer(body, "top_logprobs", 0, 2**31)
        if top is not None and top > 0 and not out.report_logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        out.top_logprobs = top or 0
    else:  # legacy completions: logprobs is the number of alternatives (0: the chosen token only)
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "top_logprobs is a chat parameter; /v1/completions takes logprobs: N")
        top = integer(body, "logprobs", 0, 2**31)
        out.report_logprobs = top is not None
        out.top_logprobs = top or 0
    if out.top_logprobs > MAX_TOP_LOGPROBS:
        param = "top_logprobs" if chat else "logprobs"
        raise bad(param, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {out.top_logprobs}")
    out.n = integer(body, "n", 1, 2**31) or 1
    best_of = integer(body, "best_of", 1, 2**31)
    out.best_of = out.n if best_of is None else best_of
    if out.n > MAX_SAMPLES:
        raise bad("n", f"n must be in [1, {MAX_SAMPLES}] (each sample holds its own KV), got {out.n}")
    if out.best_of > MAX_SAMPLES:
        raise bad("best_of", f"best_of must be in [1, {MAX_SAMPLES}], got {out.best_of}")
    if out.best_of < out.n:
        raise bad("best_of", f"best_of ({out.best_of}) must be >= n ({out.n})")
    if out.best_of > out.n and stream:
        raise bad("best_of", "best_of > n cannot be streamed: the best samples are known only at the end")
    # best_of ranks by cumulative logprob: the engine reports them whenever it has to choose.
    s.logprobs = out.report_logprobs or out.best_of > out.n
    s.top_logprobs = out.top_logprobs
    return out


def best(logprob_lists: list[list[TokenLogprob] | None], n: int) -> list[int]:
    """Indices of the n samples of highest cumulative logprob, best first (ties: lower index)."""
    totals = [sum(lp.logprob for lp in lps or ()) for lps in logprob_lists]
    return sorted(range(len(totals)), key=lambda i: (-totals[i], i))[:n]


def chat_logprobs(logprobs: list[TokenLogprob], text_of) -> dict:
    """OpenAI chat's choice.logprobs: {content: [{token, logprob, bytes, top_logprobs}], refusal}."""

    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(logprobs: list[TokenLogprob], text_of, offset: int, top_n: int) -> dict:
    """Legacy completions' choice.logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}
    per position; null when logprobs was 0), text_offset (characters from the start of the completion,
    `offset` for the first token of this piece)."""
    tokens, offsets = [], []
    for lp in logprobs:
        text = text_of(lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{text_of(t): v for t, v in lp.top} for lp in logprobs] if top_n else None,
        "text_offset": offsets,
    }
