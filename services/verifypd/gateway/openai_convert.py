"""OpenAI-compatible JSON <-> the public `GenerateRequest` and the engine's chunks. Torch-free.

The HTTP API goes through the same path as gRPC: a JSON body is checked for *shape* here (types,
unknown or unsupported parameters; the sampling controls, logprobs and n / best_of in
openai_sampling) and turned into a `generate_pb2.GenerateRequest`; from
there `convert.request_spec_from_pb` and the engine do every range check, exactly as for gRPC.
Their messages name wire fields (`sampling.top_p`, `stop[1]`, `chat.messages[0].role`, ...);
`openai_param` maps them back to the OpenAI parameter, so a 400 always names what the client sent.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
import time
from dataclasses import dataclass

from verifypd.domain.requests import FinishReason
from verifypd.gateway import openai_sampling as osm
from verifypd.gateway import structured, tools
from verifypd.gateway.errors import ApiError, bad
from verifypd.gateway.json_body import JsonBodyError, parse_json_body
from verifypd.gateway.messages import message_text
from verifypd.v1 import generate_pb2

CHAT, COMPLETION = "chat", "completion"
U32, I32 = 2**32, 2**31

# Accepted by both endpoints (ours: top_k, priority, speculation, ignore_eos).
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "top_k",
    "priority",
    "speculation",
    "ignore_eos",
    "response_format",  # and the vLLM-style extensions (structured output, gateway.structured):
    "guided_json",
    "guided_regex",
    "guided_grammar",
}
_ONLY = {CHAT: {"messages", "max_completion_tokens", *tools.PARAMS}, COMPLETION: {"prompt"}}
# OpenAI parameters we do not implement: accepted only at their neutral value (clients often send it).
_NEUTRAL: dict[str, tuple[object, ...] | None] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "echo": (False,),
    "suffix": ("",),
    "metadata": None,
    "store": (False,),
    "service_tier": None,
}  # None: any value, ignored
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    None: None,
    FinishReason.CANCELLED: "stop",
}


def decode_body(body: bytes | bytearray):
    """An HTTP request body -> its JSON value, within the depth and text limits of `json_body`."""
    try:
        return parse_json_body(body)
    except JsonBodyError as exc:
        raise ApiError(400, str(exc), None, exc.code) from None


@dataclass
class ParsedRequest:
    kind: str  # CHAT | COMPLETION
    model: str
    pb: generate_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    max_tokens_param: str  # which name the client used (for error messages)
    samples: osm.Samples = dataclasses.field(default_factory=osm.Samples)  # n, best_of, logprobs to report
    # Chat with tools or tool history: the prompt is rendered by the gateway (tools.render).
    tools: tools.ToolRequest | None = None


# -- typed getters: None/absent = unset; a wrong type is a 400 naming the parameter ------------
def _get(body: dict, name: str, types: tuple, what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise bad(name, f"{name} must be {what}, got {type(value).__name__} {value!r:.40}")
    return value


def _int(body, name, lo: int, hi: int):
    value = _get(body, name, (int,), "an integer")
    if value is not None and not lo <= value < hi:
        raise bad(name, f"{name} must be in [{lo}, {hi}), got {value}")
    return value


def _number(body, name):
    value = _get(body, name, (int, float), "a number")
    return None if value is None else float(value)


F32_TINY = struct.unpack("<f", struct.pack("<I", 1))[0]  # the smallest float32 > 0 (1.4e-45)


def _float32(body, name):
    """A number parameter as the wire's float32 holds it (what gRPC and the engine will see): too
    large for float32 is refused here, naming the parameter, rather than becoming inf."""
    value = _number(body, name)
    if value is None or not math.isfinite(value):
        return value  # nan / inf: the engine's own range check names them
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        raise bad(name, f"{name} is out of range (float32), got {body[name]}") from None


def _prompt(body: dict, kind: str, req: generate_pb2.GenerateRequest) -> None:
    if kind == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
            role = m.get("role")
            if role not in _ROLES:
                raise bad(
                    f"messages[{i}].role",
                    f"messages[{i}].role must be one of system, developer, user, assistant; got {role!r:.40}",
                )
            text = message_text(m.get("content"), f"messages[{i}].content")
            req.chat.messages.add(role=_ROLES[role], content=text)
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < U32 for t in prompt):
            raise bad("prompt", "prompt token ids must be >= 0")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "prompt: one prompt per request (a batch of prompts is not supported)")
    else:
        raise bad("prompt", "prompt must be a string or a non-empty list of token ids")


def parse_request(body, kind: str, *, request_id: str) -> ParsedRequest:
    """JSON body of /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) -> GenerateRequest."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name in body:
        if name in _COMMON or name in _ONLY[kind] or name in osm.PARAMS:
            continue
        if name in _NEUTRAL:
            allowed = _NEUTRAL[name]
            if allowed is None or body[name] is None or body[name] in allowed:
                continue
            raise bad(name, f"{name} is not supported by this server (leave it unset)")
        raise bad(name, f"unrecognized request argument supplied: {name}")
    model = _get(body, "model", (str,), "a string")
    if not model:
        raise bad("model", "model is required (see GET /v1/models)")
    req = generate_pb2.GenerateRequest(request_id=request_id)
    tool_request = tools.parse(body) if kind == CHAT and tools.wanted(body) else None
    if tool_request is None:
        _prompt(body, kind, req)
    mt_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_param, 1, U32)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    temperature, top_p = _float32(body, "temperature"), _float32(body, "top_p")
    if temperature is not None:
        req.sampling.temperature = temperature  # one below float32's smallest is 0: greedy, as it would be anyway
    if top_p is not None:
        # The wire's 0 means "unset" (= 1); OpenAI's 0 is a value the engine refuses, and so is one that
        # float32 (the wire's type, as gRPC clients send it) cannot tell from 0.
        if top_p == 0:
            raise bad("top_p", f"top_p must be in (0, 1] (as a float32: at least {F32_TINY:.3g}), got {body['top_p']}")
        req.sampling.top_p = top_p
    for name, lo, hi in (("top_k", -I32, I32), ("priority", -I32, I32)):
        value = _int(body, name, lo, hi)
        if value is not None:
            setattr(req.sampling if name == "top_k" else req, name, value)
    seed = _int(body, "seed", 0, 2**64)
    if seed is not None:
        req.sampling.seed = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop", "stop must be a string or a list of strings")
        req.stop.extend(stops)
    ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean")
    if ignore_eos is not None:
        req.stop_at_eos = not ignore_eos
    _speculation(body, req)
    constraint = structured.constraint_of(body)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad("stream_options", f"stream_options: unknown field {sorted(unknown)[0]}")
        include_usage = bool(_get(options, "include_usage", (bool,), "a boolean"))
    _get(body, "user", (str,), "a string")
    samples = osm.parse(body, kind == CHAT, req, _get, _int, _number, stream)
    if tool_request is not None and (samples.n > 1 or samples.best_of > 1 or samples.report_logprobs):
        raise bad("tools with n > 1, best_of or logprobs are not supported", "tools")
    return ParsedRequest(kind, model, req, stream, include_usage, mt_param, samples, tool_request)


def _speculation(body: dict, req: generate_pb2.GenerateRequest) -> None:
    """`"speculation": {"max_k": K}` or `{"disable": true}`, like the gRPC SpeculationOverride."""
    spec = _get(body, "speculation", (dict,), 'an object: {"max_k": K} or {"disable": true}')
    if spec is None:
        return
    if set(spec) - {"max_k", "disable"} or len(spec) != 1:
        raise bad("speculation", 'speculation must be {"max_k": K} or {"disable": true}')
    if "disable" in spec:
        req.speculation.disable = bool(_get(spec, "disable", (bool,), "a boolean"))
    else:
        value = spec["max_k"]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < U32:
            raise bad("speculation.max_k", f"speculation.max_k must be an integer >= 0, got {value!r:.40}")
        req.speculation.max_k = value


# Wire field (at the start of an engine/convert message) -> OpenAI parameter.
_FIELD_PARAMS = [
    ("sampling.", ""),
    ("chat.messages", "messages"),
    ("text", "prompt"),
    ("token_ids", "prompt"),
    ("prompt token ids", "prompt"),
    ("prompt", "prompt"),
    ("max_tokens", "max_tokens"),
    ("speculation.max_k", "speculation.max_k"),
    ("k ", "speculation.max_k"),
    ("priority", "priority"),
    ("constraint", "response_format"),
    ("response_format", "response_format"),
]


def openai_param(message: str, parsed: ParsedRequest) -> tuple[str | None, str]:
    """The OpenAI parameter an InvalidRequest message is about, and the message in OpenAI's words."""
    prompt = "messages" if parsed.kind == CHAT else "prompt"
    if message.startswith("constraint") and parsed.tools is not None and parsed.tools.constrained:
        return "tool_choice", message  # the calls' grammar (tools.call_grammar)
    if "chat template" in message or "no tokenizer" in message:
        return prompt, message.replace("send the prompt as text or token_ids", "use /v1/completions")
    m = re.match(r"stop\[(\d+)\]", message)
    if m:
        return f"stop[{m.group(1)}]", message
    for field, param in _FIELD_PARAMS:
        if message.startswith(field):
            # The engine's messages name the field (domain.convert, domain.tokenizer); one that did
            # not would name no parameter.
            if field == "sampling.":
                name = re.match(r"sampling\.(\w+)", message)
                return (name.group(1) if name else None), message[len(field) :]
            if param == "messages":
                rest = message[len("chat.") :]
                path = re.match(r"[\w\[\]]+(\.\w+)?", rest)
                return (path.group(0) if path else None), rest
            if param == "prompt":
                return prompt, message
            if param == "max_tokens":
                return parsed.max_tokens_param, message.replace("max_tokens", parsed.max_tokens_param, 1)
            return param, message
    return None, message


def finish_reason(reason: FinishReason | None) -> str | None:
    return _FINISH[reason]


def usage_json(usage: dict) -> dict:
    """Engine usage -> OpenAI's, with speculation in completion_tokens_details (accepted / rejected
    draft tokens) and our own counts under "verifypd"."""
    drafted, accepted = usage["draft_tokens"], usage["accepted_tokens"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        # prompt tokens served from the prefix cache, as OpenAI reports its own prompt caching
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
            "reasoning_tokens": 0,
        },
        "verifypd": {"draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": usage["verify_steps"]},
    }


def now() -> int:
    return int(time.time())
