"""Fixtures of this room's tests: the chat-template copy of the tiny target (support/http_helpers.py);
`tiny_models` comes from tests/conftest.py."""

from __future__ import annotations

from http_helpers import chat_models  # noqa: F401 (a fixture: pytest finds it in this conftest)
