"""One tool call's JSON object, scanned as it is generated (tool_stream.py): its name, and where
its arguments value starts and ends, so the arguments' raw text can be streamed before the object
is complete. Torch-free.
"""

from __future__ import annotations

import json

WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")  # "parameters": Llama 3's


class _Fail(Exception):
    """The text since the call marker is not a call object."""


class CallObject:
    """Scans one call's JSON object character by character: its name, and where its arguments
    value starts and ends (the raw text between is the `arguments` string)."""

    def __init__(self) -> None:
        self.text = ""
        self.state = "open"  # open, key_or_end, key_next, key, colon, value_start, value, after_value, done
        self.failed = False
        self.key = ""
        self.name: str | None = None
        self.args_start = self.args_end = -1
        self.value_start = 0
        self.depth = 0  # of the container value being scanned
        self.in_string = self.escaped = False
        self.value_kind = ""  # string | container | primitive

    def feed(self, text: str) -> int:
        """Consumes `text` up to the end of the object (or the character that broke it: `failed`);
        returns how many characters it took."""
        for n, ch in enumerate(text):
            try:
                self._char(ch)
            except _Fail:
                self.failed = True
                return n + 1
            if self.state == "done":
                return n + 1
        return len(text)

    def _char(self, ch: str) -> None:
        pos = len(self.text)
        self.text += ch
        s = self.state
        if s == "value":
            self._value_char(ch, pos)
        elif s == "key":
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.key = json.loads(self.text[self.value_start :])
                self.state = "colon"
        elif ch in WS:
            return
        elif s == "open":
            self._expect(ch == "{", "key_or_end")
        elif s == "key_or_end" and ch == "}":
            self.state = "done"
        elif s in ("key_or_end", "key_next"):
            self._expect(ch == '"', "key")
            self.value_start = pos
        elif s == "colon":
            self._expect(ch == ":", "value_start")
        elif s == "value_start":
            self.state, self.value_start, self.depth = "value", pos, 0
            self.in_string = self.escaped = False
            self.value_kind = "string" if ch == '"' else "container" if ch in "{[" else "primitive"
            if self.key in _ARGUMENT_KEYS:
                self.args_start = pos
            self._value_char(ch, pos)
        elif s == "after_value":
            self._expect(ch in ",}", "key_next" if ch == "," else "done")
        else:
            raise _Fail

    def _expect(self, ok: bool, state: str) -> None:
        if not ok:
            raise _Fail
        self.state = state

    def _value_char(self, ch: str, pos: int) -> None:
        kind = self.value_kind
        if kind == "primitive":
            if ch in WS or ch in ",}":
                self._end_value(pos)
                self.text = self.text[:pos]
                self._char(ch)  # the delimiter belongs to the object
            return
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if kind == "string":
                    self._end_value(pos + 1)
            return
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_value(pos + 1)

    def _end_value(self, end: int) -> None:
        raw = self.text[self.value_start : end]
        if self.key == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                raise _Fail from None
            if not isinstance(name, str):
                raise _Fail
            self.name = name
        elif self.key in _ARGUMENT_KEYS:
            self.args_end = end
        self.state = "after_value"
