"""Fixtures of the services tests (helpers live in services_helpers.py and http_helpers.py): the
shared fixtures are imported here once, so the test modules take them by name without importing."""

from __future__ import annotations

from http_helpers import chat_models  # noqa: F401 (a fixture: pytest finds it in this conftest)
from services_helpers import tiny_models  # noqa: F401 (a fixture)
