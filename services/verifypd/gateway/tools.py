"""Tool calling in the OpenAI chat API, the request side: `tools`, `tool_choice`,
`parallel_tool_calls`, `role: "tool"` messages and assistant `tool_calls` in the history. Torch-free.

`parse` checks the shape (a 400 names the field) and keeps the messages in the form chat templates
expect (HF convention: a call's arguments as a dict, a tool result with its tool_call_id and name).
Rendering the prompt and the calls' grammar: tool_render.py; the output side (parsing calls,
streaming deltas): tool_stream.py. docs/structured_output.md "Tools".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from verifypd.gateway.errors import bad
from verifypd.gateway.messages import message_text

HERMES, LLAMA3 = "hermes", "llama3"
PARSERS = ("auto", HERMES, LLAMA3)
PARAMS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    """A chat request's tools and history in template form (`parse`); `parser` is set by `render`."""

    tools: list[dict]  # {"type": "function", "function": {name, description?, parameters}}
    choice: str  # "none" | "auto" | "required" | "function" (a named function: `named`)
    named: str | None
    parallel: bool
    messages: list[dict]
    parser: str = HERMES  # the output format: HERMES | LLAMA3 (render decides)
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.names = tuple(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for calls (`none` renders the tools, never parses)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")


def wanted(body: dict) -> bool:
    """Whether a chat body needs the tool path: tools, a forcing tool_choice, or tool history."""
    messages = body.get("messages")
    history = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )
    choice = body.get("tool_choice")
    return bool(body.get("tools")) or history or choice not in (None, "none", "auto")


def parse(body: dict) -> ToolRequest:
    tools = _tools(body.get("tools"))
    names = [t["function"]["name"] for t in tools]
    choice, named = _choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    return ToolRequest(tools, choice, named, parallel, _messages(body.get("messages")))


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "tools must be a list of {type: function, function: {name, parameters}} objects")
    out, seen = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"{where}.type", f'{where} must be an object with type "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}.function", f"{where}.function must be an object {{name, description, parameters}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(
                f"{where}.function.name",
                f"{where}.function.name must be 1-64 letters, digits, underscores, dots or dashes; got {name!r:.40}",
            )
        if name in seen:
            raise bad(f"{where}.function.name", f"{where}.function.name: {name!r} is defined twice")
        seen.add(name)
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        if params is None:
            params = _EMPTY_PARAMETERS
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad(
                f"{where}.function.parameters",
                f'{where}.function.parameters must be a JSON schema of type "object" (the arguments object)',
            )
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"{where}.function.description", f"{where}.function.description must be a string")
        clean = {"name": name} | ({"description": description} if description else {}) | {"parameters": params}
        out.append({"type": "function", "function": clean})
    return out


def _choice(value, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not names:
            raise bad("tool_choice", 'tool_choice "required" needs tools: give at least one function in tools')
        return value, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    if name not in names:
        raise bad("tool_choice", f"tool_choice names the function {name!r:.70}, which is not in tools")
    return "function", name


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    names_by_id: dict[str, str] = {}  # a tool result's function name, from the call it answers
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content")
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad(
                f"{where}.role",
                f"{where}.role must be one of system, developer, user, assistant, tool; got {m.get('role')!r:.40}",
            )
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages carry tool calls")
        text = message_text(m.get("content"), f"{where}.content", optional=role == "assistant" and bool(calls))
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.tool_call_id", f'{where}.tool_call_id is required for role "tool"')
            result = {"role": "tool", "tool_call_id": call_id, "content": text}
            name = m.get("name") or names_by_id.get(call_id)
            out.append(result | ({"name": name} if isinstance(name, str) else {}))
            continue
        msg: dict = {"role": role, "content": text}
        if calls:
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list of calls")
            history = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            names_by_id.update({c["id"]: c["function"]["name"] for c in history if c.get("id")})
            msg["tool_calls"] = history
        out.append(msg)
    return out


def _history_call(call, where: str) -> dict:
    """An assistant's earlier call, its arguments as a dict (what HF chat templates iterate)."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise bad(where, f'{where} must be an object {{id, type: "function", function: {{name, arguments}}}}')
    fn = call.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    assert isinstance(fn, dict)
    raw = fn.get("arguments", "{}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object (as a string)")
    call_id = call.get("id")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return out | ({"id": call_id} if isinstance(call_id, str) else {})
