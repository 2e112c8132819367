"""The results JSON document (layout documented in docs/loadgen.md, version SCHEMA_VERSION)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import subprocess
from pathlib import Path

from verifypd_loadgen import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, __version__

# Maps whose keys depend on the data (status codes, k values, priorities): key_paths() stops
# at them, so the layout check sees only the fixed part of the document.
DYNAMIC_MAPS = (
    "runs[].summary.errors",
    "runs[].summary.speculation.applied_k",
    "runs[].summary.by_priority",
)
SERVER_INFO_KEYS = ("target_model", "draft_model", "topology", "max_context", "version")


class SchemaError(ValueError):
    pass


def git_revision() -> str | None:
    """Commit of the checkout loadgen runs from (or $VERIFYPD_GIT_REVISION), '+dirty' when
    tracked files differ. Read-only: GIT_OPTIONAL_LOCKS=0 keeps git from touching the index."""
    if os.environ.get("VERIFYPD_GIT_REVISION"):
        return os.environ["VERIFYPD_GIT_REVISION"]
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")
    here = str(Path(__file__).resolve().parent)
    try:
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, env=env
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "-uno"], capture_output=True, text=True, timeout=5, env=env
        )
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def server_info_block(info: dict | None, status: str) -> dict:
    """Always the same keys; values None when GetServerInfo failed (status says why)."""
    info = info or {}
    return {"status": status, **{k: info.get(k) for k in SERVER_INFO_KEYS}}


def build_results(config: dict, server_info: dict, warmup: dict, runs: list[dict], label: str | None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "verifypd-loadgen", "version": __version__},
        "label": label,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "config": config,
        "server_info": server_info,
        "warmup": warmup,
        "runs": runs,
    }


def _clean(obj):
    """JSON has no inf/nan: an infinite rate is written as the string "inf"."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dump(doc: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(_clean(doc), indent=2) + "\n", encoding="utf-8")


def key_paths(doc, prefix: str = "") -> list[str]:
    """Sorted dotted paths of every key (list items as `[]`), not descending DYNAMIC_MAPS."""
    paths: set[str] = set()
    if isinstance(doc, dict):
        for k, v in doc.items():
            p = f"{prefix}.{k}" if prefix else k
            paths.add(p)
            if p not in DYNAMIC_MAPS:
                paths.update(key_paths(v, p))
    elif isinstance(doc, list):
        for v in doc:
            paths.update(key_paths(v, prefix + "[]"))
    return sorted(paths)


def load(path: str | Path) -> dict:
    """Reads and checks a results file; SchemaError with a one-line reason otherwise."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise SchemaError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise SchemaError(f"{path}: not a verifypd-loadgen results file")
    if doc["schema_version"] not in READABLE_SCHEMA_VERSIONS:
        raise SchemaError(
            f"{path}: schema_version {doc['schema_version']} "
            f"(this loadgen reads {', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
        )
    for key in ("config", "runs"):
        if key not in doc:
            raise SchemaError(f"{path}: missing {key!r}")
    return doc
