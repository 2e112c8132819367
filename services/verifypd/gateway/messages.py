"""Chat message content as the OpenAI API sends it. Torch-free."""

from __future__ import annotations

from verifypd.gateway.errors import bad


def message_text(content, where: str, *, optional: bool = False) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined);
    `optional`: None reads as "" (an assistant message that only calls tools). Errors name `where`."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}[{i}]", f"{where}[{i}]: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a list of text parts")
