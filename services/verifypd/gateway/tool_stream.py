"""Tool calling in the OpenAI chat API, the output side: the model's text -> `content` and
`tool_calls`, incrementally, so a stream and a whole answer are parsed by the same machine (a
streamed answer's deltas add up to the non-streamed message). Torch-free.

Formats (tools.py picks one per request):
  hermes  (Hermes, Qwen 2.5/3, the generic rendering): <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
          one or more, whitespace around the JSON allowed;
  llama3  (Llama 3.x): {"name": ..., "parameters": {...}} (or "arguments"), optionally after
          <|python_tag|> (a special token the detokenizer usually drops), several separated by ";".
Text before a call is content; a suffix that may be the start of a call marker is held back until
it is decided; whitespace next to a call is dropped. A call whose name is not one of the request's
functions, or whose JSON breaks before its name is known, is content after all (its text as it came).
A call's `arguments` string is the raw JSON text of the model's arguments object, streamed as it
comes once the name is known.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from verifypd.gateway.tool_call_json import WS, CallObject
from verifypd.gateway.tools import ToolRequest

HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')
# A tail that may still grow into _LLAMA_CALL.
_LLAMA_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Delta:
    """One parser event: content text, a call's header (`name` set) or a piece of its arguments."""

    content: str | None = None
    index: int = -1  # the call's index in the answer's tool_calls
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallParser:
    """Text in (`feed`, then `finish`), deltas out. `names`: the request's functions; calls past
    `max_calls` (parallel_tool_calls false: one) are parsed and dropped."""

    def __init__(self, fmt: str, names: tuple[str, ...], max_calls: int | None = None):
        self.fmt, self.names, self.max_calls = fmt, set(names), max_calls
        # content | call | close (hermes: up to </tool_call>) | separator (llama3: ";" between calls)
        self.mode = "content"
        self.held = ""  # text that may still become a marker (content) or the close tag (close)
        self.pending_ws = ""  # trailing whitespace of the content: dropped if a call follows
        self.after_call = False  # no content since the last call (its leading whitespace is dropped)
        self.calls: list[tuple[str, str]] = []  # (id, name) of the calls given out
        self.marker = ""  # the current call's marker text (content again if it is no call)
        self.ws_before = ""  # the whitespace before it (likewise)
        self.obj: CallObject | None = None
        self.call_id = ""
        self.header_out = False
        self.args_sent = 0  # characters of the current call's arguments given out

    # -- public --------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        text = self.held + text
        self.held = ""
        while text:
            if self.mode == "content":
                text = self._content(text, out)
            elif self.mode == "call":
                text = self._call(text, out)
            else:
                text = self._close(text)
        return out

    def finish(self) -> list[Delta]:
        """The end of the output: held text is content; a cut call keeps what it has."""
        out: list[Delta] = []
        if self.mode == "call":
            assert self.obj is not None
            if self.header_out:
                self._args(out, final=True)
                self._end_call()
            else:
                self.pending_ws = self.ws_before
                self._content_text(self.marker + self.obj.text, out)
        elif self.mode == "content" and self.held:
            self._content_text(self.held, out)
        self.held, self.mode = "", "content"
        if not self.calls and self.pending_ws:
            out.append(Delta(content=self.pending_ws))
        self.pending_ws = ""
        return out

    @property
    def called(self) -> bool:
        return bool(self.calls)

    # -- content -------------------------------------------------------------------------------
    def _marker(self, text: str) -> tuple[int, int]:
        """(start, length) of the first call marker in `text`, (-1, 0) if none. A Llama JSON call's
        marker is empty: the object is scanned from its opening brace."""
        if self.fmt == "hermes":
            p = text.find(HERMES_OPEN)
            return (p, len(HERMES_OPEN)) if p >= 0 else (-1, 0)
        found = [(p, len(PYTHON_TAG)) for p in [text.find(PYTHON_TAG)] if p >= 0]
        m = _LLAMA_CALL.search(text)
        if m:
            found.append((m.start(), 0))
        return min(found) if found else (-1, 0)

    def _holdback(self, text: str) -> int:
        """How many trailing characters may still become a marker."""
        marker = HERMES_OPEN if self.fmt == "hermes" else PYTHON_TAG
        hold = next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)
        if self.fmt != "hermes":
            brace = text.rfind("{")
            if brace >= 0 and _LLAMA_PREFIX.fullmatch(text, brace):
                hold = max(hold, len(text) - brace)
        return hold

    def _content(self, text: str, out: list[Delta]) -> str:
        start, length = self._marker(text)
        if start < 0:
            hold = self._holdback(text)
            self._content_text(text[: len(text) - hold], out)
            self.held = text[len(text) - hold :]
            return ""
        self._content_text(text[:start], out)
        self.ws_before, self.pending_ws = self.pending_ws, ""  # (given back if this is no call)
        self.mode, self.marker = "call", text[start : start + length]
        self.obj, self.header_out, self.args_sent = CallObject(), False, 0
        return text[start + length :]

    def _content_text(self, text: str, out: list[Delta]) -> None:
        s = self.pending_ws + text
        if self.after_call:
            s = s.lstrip(WS)
        body = s.rstrip(WS)
        self.pending_ws = s[len(body) :]
        if body:
            out.append(Delta(content=body))
            self.after_call = False

    # -- calls ---------------------------------------------------------------------------------
    def _call(self, text: str, out: list[Delta]) -> str:
        obj = self.obj
        assert obj is not None
        taken = obj.feed(text)
        rest = text[taken:]
        if obj.failed and not self.header_out:
            return self._not_a_call(rest, out)
        if obj.name is not None and not self.header_out:
            if obj.name not in self.names:
                return self._not_a_call(rest, out)
            self.header_out, self.call_id = True, new_call_id()
            if not self._dropped():
                out.append(Delta(index=len(self.calls), call_id=self.call_id, name=obj.name, arguments=""))
        if self.header_out:
            self._args(out, final=obj.state == "done" or obj.failed)
        if obj.failed:  # broken after its name: the call keeps what it has, the rest is content
            self._end_call()
            self.mode = "content"
        elif obj.state == "done":
            if not self.header_out:  # an object without a name
                return self._not_a_call(rest, out)
            self._end_call()
        return rest

    def _not_a_call(self, rest: str, out: list[Delta]) -> str:
        """The marker and the object so far go out as content; scanning goes on after them."""
        assert self.obj is not None
        self.pending_ws = self.ws_before
        self._content_text(self.marker + self.obj.text, out)
        self.mode, self.obj = "content", None
        return rest

    def _dropped(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _args(self, out: list[Delta], final: bool) -> None:
        obj = self.obj
        assert obj is not None
        if obj.args_start < 0:  # no arguments (yet)
            if final and not self._dropped():
                out.append(Delta(index=len(self.calls), arguments="{}"))
            return
        end = obj.args_end if obj.args_end >= 0 else len(obj.text)
        piece = obj.text[obj.args_start + self.args_sent : end]
        self.args_sent += len(piece)
        if piece and not self._dropped():
            out.append(Delta(index=len(self.calls), arguments=piece))

    def _end_call(self) -> None:
        assert self.obj is not None and self.obj.name is not None
        if not self._dropped():
            self.calls.append((self.call_id, self.obj.name))
        self.obj, self.after_call = None, True
        self.mode = "close" if self.marker == HERMES_OPEN else "separator"

    def _close(self, text: str) -> str:
        """After a call: hermes' </tool_call> (whitespace before it allowed), Llama's ";"."""
        stripped = text.lstrip(WS + (";" if self.mode == "separator" else ""))
        if not stripped:
            return ""
        if self.mode == "separator":
            self.mode = "content"
            return stripped
        if stripped.startswith(HERMES_CLOSE):
            self.mode = "content"
            return stripped[len(HERMES_CLOSE) :]
        if HERMES_CLOSE.startswith(stripped):
            self.held = stripped
            return ""
        self.mode = "content"  # no close tag: the rest is content
        return stripped


def parse_all(fmt: str, names: tuple[str, ...], text: str, max_calls: int | None = None):
    """A whole output -> (content or None, [{id, type, function: {name, arguments}}])."""
    parser = ToolCallParser(fmt, names, max_calls)
    content: list[str] = []
    calls: list[dict] = []
    for d in [*parser.feed(text), *parser.finish()]:
        if d.content is not None:
            content.append(d.content)
        elif d.name is not None:
            calls.append({"id": d.call_id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        if d.arguments:
            calls[d.index]["function"]["arguments"] += d.arguments
    return ("".join(content) or None), calls


def delta_json(d: Delta) -> dict:
    """OpenAI's chat.completion.chunk delta of one parser event."""
    if d.content is not None:
        return {"content": d.content}
    call: dict = {"index": d.index}
    if d.name is not None:
        call |= {"id": d.call_id, "type": "function", "function": {"name": d.name, "arguments": d.arguments or ""}}
    else:
        call["function"] = {"arguments": d.arguments}
    return {"tool_calls": [call]}


def _max_calls(req: ToolRequest) -> int | None:
    return None if req.parallel else 1


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def chat_choice(req: ToolRequest, text: str, reason: str | None) -> dict:
    """The non-streamed choice of a request whose output is parsed for calls."""
    content, calls = parse_all(req.parser, req.names, text, _max_calls(req))
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(reason, bool(calls))}


class StreamDeltas:
    """A streamed request's chunks -> OpenAI choice deltas (`choices[0]` of each event)."""

    def __init__(self, req: ToolRequest):
        self.parser = ToolCallParser(req.parser, req.names, _max_calls(req))

    def choices(self, text: str, finished: bool, reason: str | None) -> list[dict]:
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        out: list[dict] = [
            {"index": 0, "delta": delta_json(d), "logprobs": None, "finish_reason": None} for d in events
        ]
        if finished:  # the finish reason in a last, empty delta (as OpenAI sends it)
            out.append(
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish(reason, self.parser.called)}
            )
        return out
