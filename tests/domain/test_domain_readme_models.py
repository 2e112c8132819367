"""The README's "Supported models" table is the loader's own table (model.families.FAMILY_NAMES):
the same families, display names and model types, in the same order."""

from __future__ import annotations

import pathlib
import re

from verifypd.model.families import FAMILY_NAMES, SUPPORTED_TYPES

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_models() -> list[tuple[str, str]]:
    """(family, model_type) of each row of the table under '### Supported models'."""
    text = README.read_text()
    section = text.split("### Supported models", 1)[1]
    rows = re.findall(r"^\| ([^|`]+?) \| `([a-z0-9_]+)` \|", section.split("\n\n|", 1)[1], re.M)
    return [(name.strip(), kind) for name, kind in rows]


def test_readme_lists_exactly_the_supported_families():
    assert readme_models() == [(name, kind) for kind, name in FAMILY_NAMES.items()]
    assert tuple(kind for _, kind in readme_models()) == SUPPORTED_TYPES
