"""EAGLE-3-style draft heads shipped inside the package (torch-free: names and directories only).

`--draft eagle:NAME` and `eagle+ngram:NAME` take a shipped head by name wherever they take a head's
directory: `verifypd serve --draft eagle:smollm2` drafts for the embedded SmolLM2-135M-Instruct with
the head in `smollm2_eagle/` (its README.md says how it was trained).
"""

from __future__ import annotations

from pathlib import Path

_DIRS = {"smollm2": "smollm2_eagle"}  # name -> directory beside this file (config.json + model.safetensors)

SHIPPED_HEADS: tuple[str, ...] = tuple(_DIRS)


def shipped_head(name: str) -> str | None:
    """The directory of the shipped head called `name`, or None when `name` is not one (a path, with a
    separator, never is: a head on disk is given by its path)."""
    if "/" in name or "\\" in name or name not in _DIRS:
        return None
    return str(Path(__file__).resolve().parent / _DIRS[name])
