"""Tool calling, the prompt and the constraint: a chat request's tools and history (tools.py)
rendered to prompt token ids with the model's chat template, and the grammar of the calls a forcing
`tool_choice` allows. Torch-free.

The template's own tool support where it renders `tools`; else the generic Hermes-style system
message of `tools_system_prompt`. `tool_choice` required or a named function constrains the output
(`call_grammar`, llguidance) to calls in the parser's format, so their arguments always parse
against the function's schema. docs/structured_output.md "Tools".
"""

from __future__ import annotations

import json

from verifypd.domain import grammar
from verifypd.domain.requests import Constraint, InvalidRequest
from verifypd.gateway.errors import bad
from verifypd.gateway.tools import HERMES, LLAMA3, ToolRequest
from verifypd.v1 import generate_pb2


def template_of(tokenizer) -> str:
    """The template `apply_chat_template(tools=...)` would use (a named "tool_use" one first)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default")
    return t if isinstance(t, str) else ""


def renders_tools(template: str) -> bool:
    """Whether the template reads the `tools` variable (else it would drop the tools silently)."""
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def detect_parser(template: str, native: bool) -> str:
    """`--tool-parser auto`: Llama 3.x's JSON calls where the template is Llama 3's (its python tag,
    or its instruction to answer with {"name", "parameters"}); Hermes/Qwen's <tool_call> otherwise,
    which is also what the generic rendering asks for."""
    if native and ("<|python_tag|>" in template or '"parameters": dictionary' in template):
        return LLAMA3
    return HERMES


def tools_system_prompt(tools: list[dict]) -> str:
    """The generic rendering of tools for a template that has no tool support (Hermes/Qwen style)."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to answer the user.\n\n"
        f"The functions' signatures are inside <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with its name and arguments as a JSON object inside "
        "<tool_call></tool_call> XML tags, one call per tag:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )


def hermes_call_text(call: dict) -> str:
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}) + "\n</tool_call>"


def generic_messages(req: ToolRequest) -> list[dict]:
    """The history in system/user/assistant messages only: the tools in the system message, calls as
    <tool_call> text, results as <tool_response> in a user message (consecutive results merged)."""
    out: list[dict] = []
    messages = list(req.messages)
    if req.tools:
        head = tools_system_prompt(req.tools)
        if messages and messages[0]["role"] == "system":
            head = messages.pop(0)["content"] + "\n\n" + head
        out.append({"role": "system", "content": head})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(hermes_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append(dict(m))
    return [{"role": m["role"], "content": m["content"]} for m in out]


def render(req: ToolRequest, codec, pb: generate_pb2.GenerateRequest, parser_flag: str = "auto") -> None:
    """Sets `pb`'s prompt to the rendered token ids, `req.parser`, and for a forcing tool_choice the
    output constraint; an ApiError (400) names the field a problem is about."""
    tokenizer = getattr(codec, "tokenizer", None)
    template = template_of(tokenizer) if tokenizer is not None else ""
    if tokenizer is None or not template:
        raise bad("messages", "this model has no chat template: tools need one (or use /v1/completions)")
    native = renders_tools(template)
    req.parser = detect_parser(template, native) if parser_flag == "auto" else parser_flag
    kwargs = {"tools": req.tools or None} if native else {}
    messages = req.messages if native else generic_messages(req)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as exc:  # a template's raise_exception, or one that cannot take this history
        raise bad("messages", f"the chat template could not render these messages: {exc}"[:500]) from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    pb.ClearField("chat")
    pb.token_ids.ids.extend(list(ids))
    if req.constrained:
        if pb.HasField("constraint"):
            raise bad("tool_choice", f"tool_choice {req.choice!r} constrains the output; drop response_format")
        pb.constraint.grammar = call_grammar(req)


def _call_schema(fn: dict, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, arguments_key: fn["parameters"]},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": grammar.JSON_LAYOUT,  # name first, then the arguments, json.dumps layout
    }


def call_grammar(req: ToolRequest) -> str:
    """A Lark grammar (llguidance's dialect) of the calls tool_choice allows, in `req.parser`'s
    format: one call of the named function, or one or more (one without parallel_tool_calls) of
    any function; each function's schema is checked first so a bad one names its tools[i]."""
    if not grammar.available():
        raise bad("tool_choice", f"tool_choice {req.choice!r}: {grammar.INSTALL_HINT}")
    key = "parameters" if req.parser == LLAMA3 else "arguments"
    rules, alternatives = [], []
    for i, tool in enumerate(req.tools):
        fn = tool["function"]
        if req.named is not None and fn["name"] != req.named:
            continue
        schema = _call_schema(fn, key)
        try:
            grammar.check(Constraint("json_schema", json.dumps(schema), f"tools[{i}].function.parameters"))
        except InvalidRequest as exc:
            raise bad(f"tools[{i}].function.parameters", str(exc)) from None
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
        alternatives.append(f"fn{i}")
    one = req.named is not None or not req.parallel
    if req.parser == LLAMA3:
        start = "start: call" if one else 'start: call ("; " call)*'
        call = "call: " + " | ".join(alternatives)
        return "\n".join([start, call, *rules]) + "\n"
    start = "start: tagged" if one else 'start: tagged ("\\n" tagged)*'
    tagged = 'tagged: "<tool_call>\\n" call "\\n</tool_call>"'
    call = "call: " + " | ".join(alternatives)
    return "\n".join([start, tagged, call, *rules]) + "\n"
