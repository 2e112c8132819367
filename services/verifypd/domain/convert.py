"""Public API and Control messages <-> domain objects. Torch-free; the only place that knows both.

Validation that needs the proto's shape (which oneof is set, field names of the wire) happens here
so INVALID_ARGUMENT messages name the wire field; everything else is the engine's own validation
(`RequestSpec.validate`, `RuntimeConfig.validate`), whose messages start with the field name.
"""

from __future__ import annotations

import dataclasses
import secrets

from verifypd.domain import grammar
from verifypd.domain.config import LanePriorities, RuntimeConfig
from verifypd.domain.requests import (
    MAX_K,
    Constraint,
    FinishReason,
    InvalidRequest,
    RequestSpec,
    SamplingParams,
    TokenLogprob,
)
from verifypd.v1 import control_pb2, generate_pb2

DEFAULT_MAX_TOKENS = 256
MAX_REQUEST_ID_LEN = 256

FINISH_CODES = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: generate_pb2.FINISH_REASON_CANCELLED,
}
FINISH_NAMES = {v: (k.value if k else None) for k, v in FINISH_CODES.items()}  # wire enum -> "length", ...


def prompt_ids_from_pb(req: generate_pb2.GenerateRequest, codec) -> list[int]:
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt: set one of text, token_ids or chat")
    if which == "text":
        if req.text == "":
            raise InvalidRequest("text is empty: give a non-empty prompt")
        return codec.encode(req.text)
    if which == "token_ids":
        if not req.token_ids.ids:
            raise InvalidRequest("token_ids.ids is empty: give at least one token id")
        return list(req.token_ids.ids)
    if not req.chat.messages:
        raise InvalidRequest("chat.messages is empty: give at least one message")
    return codec.encode_chat([{"role": m.role, "content": m.content} for m in req.chat.messages])


def sampling_from_pb(s: generate_pb2.SamplingParams) -> SamplingParams:
    """Unset seed -> a random one (so equal requests without a seed differ)."""
    seed = s.seed if s.HasField("seed") else secrets.randbits(63)
    params = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.top_p != 0 else 1.0,
        top_k=s.top_k,
        seed=seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_tokens=s.min_tokens,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        stop_token_ids=tuple(s.stop_token_ids),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
    )
    try:
        params.validate()
    except InvalidRequest as exc:  # the engine names the field; add the message it lives in
        raise InvalidRequest(f"sampling.{exc}") from None
    return params


def max_k_from_pb(req: generate_pb2.GenerateRequest) -> int | None:
    mode = req.speculation.WhichOneof("mode") if req.HasField("speculation") else None
    if mode is None:
        return None
    if mode == "disable":
        return 0 if req.speculation.disable else None
    if req.speculation.max_k > MAX_K:
        raise InvalidRequest(f"speculation.max_k must be <= {MAX_K}, got {req.speculation.max_k}")
    return req.speculation.max_k


def request_spec_from_pb(
    req: generate_pb2.GenerateRequest, codec, *, max_context: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> RequestSpec:
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    ids = prompt_ids_from_pb(req, codec)
    for n, stop in enumerate(req.stop):
        if stop == "":
            raise InvalidRequest(f"stop[{n}] is empty: stop strings must be non-empty")
    if not (-100 <= req.priority <= 100):
        raise InvalidRequest(f"priority must be in [-100, 100], got {req.priority}")
    max_tokens = req.max_tokens or min(default_max_tokens, max(1, max_context - len(ids)))
    return RequestSpec(
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        sampling=sampling_from_pb(req.sampling),
        stop=tuple(req.stop),
        stop_at_eos=req.stop_at_eos if req.HasField("stop_at_eos") else True,
        max_k=max_k_from_pb(req),
        priority=req.priority,
        request_id=req.request_id,
        constraint=constraint_from_pb(req),
    )


def constraint_from_pb(req: generate_pb2.GenerateRequest) -> Constraint | None:
    """The request's OutputConstraint, checked (a bad schema, regex or grammar names `constraint.<form>`)."""
    if not req.HasField("constraint"):
        return None
    pb = req.constraint
    form = pb.WhichOneof("kind")
    if form is None:
        raise InvalidRequest("constraint: set one of json_object, json_schema, regex or grammar")
    if form == "json_object":
        if not pb.json_object:
            raise InvalidRequest("constraint.json_object must be true (unset the constraint for free text)")
        constraint = Constraint("json", "", "constraint.json_object")
    else:
        kind = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}[form]
        constraint = Constraint(kind, getattr(pb, form), f"constraint.{form}")
    grammar.check(constraint)
    return constraint


def response_to_pb(
    request_id: str,
    token_ids: list[int],
    text: str,
    finish: FinishReason | None,
    usage: dict,
    applied_k: int,
    elapsed_s: float,
    logprobs: list[TokenLogprob] | None = None,
) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=token_ids,
        text=text,
        finish_reason=FINISH_CODES[finish],
        usage=generate_pb2.Usage(**usage),
        applied_k=applied_k,
        server_elapsed_s=elapsed_s,
        logprobs=logprobs_to_pb(logprobs) if logprobs else None,
    )


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[generate_pb2.TokenLogprob]:
    return [
        generate_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


# -- Control ---------------------------------------------------------------------------------
def config_to_pb(c: RuntimeConfig) -> control_pb2.RuntimeConfig:
    p = c.priorities
    return control_pb2.RuntimeConfig(
        k_min=c.k_min,
        k_max=c.k_max,
        k_initial=c.k_initial,
        adaptive=c.adaptive,
        priorities=control_pb2.LanePriorities(draft=p.draft, verify=p.verify, prefill=p.prefill),
        prefill_token_budget=c.prefill_token_budget,
        revision=c.revision,
    )


def config_changes_from_pb(pb: control_pb2.RuntimeConfig, current: RuntimeConfig) -> dict:
    """Fields set in `pb` (proto3 presence) as keyword changes for `RuntimeConfig.updated`."""
    changes = {
        name: getattr(pb, name)
        for name in ("k_min", "k_max", "k_initial", "adaptive", "prefill_token_budget")
        if pb.HasField(name)
    }
    if pb.HasField("priorities"):
        lanes = {
            name: getattr(pb.priorities, name)
            for name in ("draft", "verify", "prefill")
            if pb.priorities.HasField(name)
        }
        changes["priorities"] = dataclasses.replace(current.priorities, **lanes)
    return changes


def config_from_pb(pb: control_pb2.RuntimeConfig, base: RuntimeConfig | None = None) -> RuntimeConfig:
    base = base or RuntimeConfig()
    new = dataclasses.replace(base, **config_changes_from_pb(pb, base))
    new.validate()
    return new


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FINISH_NAMES",
    "LanePriorities",
    "config_changes_from_pb",
    "config_from_pb",
    "config_to_pb",
    "request_spec_from_pb",
    "response_to_pb",
    "sampling_from_pb",
]
