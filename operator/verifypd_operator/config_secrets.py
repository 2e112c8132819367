"""The two Secrets of a config (the lanes' shared secret and Control's admin key): their keys and
mount paths, how they are built, and how their token is read back from the live object.

Both tokens are generated once by the reconcile and read back on every later one: a new token would
cut running gateways off their lanes (lane secret) or lock the operator out of them (admin key).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from .object_meta import Manifest, admin_secret_name, lane_secret_name, object_meta

# The lanes' shared secret: a Secret per config, mounted as a file into every pod that
# runs a lane or the gateway; lanes get `--secret-file`, the gateway `--lane-secret-file`.
LANE_SECRET_KEY = "lane-secret"
LANE_SECRET_DIR = "/var/run/verifypd/lane-secret"
LANE_SECRET_FILE = f"{LANE_SECRET_DIR}/{LANE_SECRET_KEY}"
# Control's admin key: a Secret per config, mounted into the gateway container only
# (`verifypd serve --admin-key-file`); the operator's Control client reads it from the API and
# presents it. Lanes never see it.
ADMIN_KEY_KEY = "admin-key"
ADMIN_KEY_DIR = "/var/run/verifypd/admin-key"
ADMIN_KEY_FILE = f"{ADMIN_KEY_DIR}/{ADMIN_KEY_KEY}"


def _token_secret(owner: Mapping[str, Any], namespace: str, name: str, key: str, token: str) -> Manifest:
    """A Secret holding one token under `key`, owned by the config (the component label is `key`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(name, namespace, key, owner),
        "data": {key: base64.b64encode(token.encode()).decode()},
    }


def _read_token(secret: Mapping[str, Any] | None, key: str) -> str | None:
    data = ((secret or {}).get("data") or {}).get(key)
    if not data:
        return None
    token = base64.b64decode(data).decode(errors="replace").strip()
    return token or None


def build_lane_secret(owner: Mapping[str, Any], namespace: str, token: str) -> Manifest:
    """The lanes' shared secret. `token` is generated once by the caller and read back from the
    live Secret on every later reconcile: rotating it would cut running gateways off their lanes."""
    return _token_secret(owner, namespace, lane_secret_name(owner["metadata"]["name"]), LANE_SECRET_KEY, token)


def read_lane_secret(secret: Mapping[str, Any] | None) -> str | None:
    """The token of a live lane Secret (as built by `build_lane_secret`); None when absent or empty."""
    return _read_token(secret, LANE_SECRET_KEY)


def build_admin_secret(owner: Mapping[str, Any], namespace: str, token: str) -> Manifest:
    """Control's admin key, kept like the lane secret (a new one would lock the operator out of
    running gateways until they restart)."""
    return _token_secret(owner, namespace, admin_secret_name(owner["metadata"]["name"]), ADMIN_KEY_KEY, token)


def read_admin_secret(secret: Mapping[str, Any] | None) -> str | None:
    return _read_token(secret, ADMIN_KEY_KEY)
