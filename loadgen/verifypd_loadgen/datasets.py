"""Prompt files: JSONL (`prompt` or `messages` per line) and ShareGPT-format JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

from verifypd_loadgen.workload import Prompt

# ShareGPT answers are text; their token count is estimated from whitespace-separated words.
# ~1.3 tokens per English word is the usual rule of thumb for BPE tokenizers. It is only an
# estimate: pass --output-len to control lengths exactly.
TOKENS_PER_WORD = 1.3


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file and the problem."""


def load_dataset(path: str | Path) -> list[Prompt]:
    """Loads a JSONL prompt file or a ShareGPT JSON file, told apart by content."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    stripped = raw.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON: {e}") from None
        prompts = _sharegpt(data, path)
    else:
        prompts = _jsonl(raw, path)
    if not prompts:
        raise DatasetError(f"{path}: no usable prompts")
    return prompts


def _jsonl(raw: str, path: Path) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{lineno}: expected a JSON object")
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise DatasetError(f"{path}:{lineno}: max_tokens must be a positive integer")
        if isinstance(obj.get("prompt"), str):
            prompts.append(Prompt(text=obj["prompt"], max_tokens=max_tokens))
        elif isinstance(obj.get("messages"), list):
            chat = []
            for m in obj["messages"]:
                if not (isinstance(m, dict) and isinstance(m.get("content"), str)):
                    raise DatasetError(f"{path}:{lineno}: each message needs a string content")
                chat.append((str(m.get("role", "user")), m["content"]))
            prompts.append(Prompt(chat=chat, max_tokens=max_tokens))
        else:
            raise DatasetError(f"{path}:{lineno}: needs a string 'prompt' or a 'messages' list")
    return prompts


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.split()) * TOKENS_PER_WORD))


def _sharegpt(data: object, path: Path) -> list[Prompt]:
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a list of conversations")
    prompts = []
    for entry in data:
        convs = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(convs, list):
            continue
        # The first human turn is the prompt; the gpt turn answering it sets the length.
        for i, turn in enumerate(convs):
            if isinstance(turn, dict) and turn.get("from") == "human" and turn.get("value"):
                answer = next(
                    (t for t in convs[i + 1 :] if isinstance(t, dict) and t.get("from") == "gpt"),
                    None,
                )
                max_tokens = estimate_tokens(answer.get("value") or "") if answer else None
                prompts.append(Prompt(text=str(turn["value"]), max_tokens=max_tokens))
                break
    return prompts
